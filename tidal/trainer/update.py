"""Policy and critic updates over one rollout's Experience (spec §7 step 9).

The rollout is split into ``mini_batches`` equal parts of whole prompt groups; each part is one
optimizer step, computed in token-budget micro-batches. Loss shares are normalised by the global
counts of the mini-batch (all micro-batches, all ranks), so gradient accumulation and data
parallelism give exactly the gradient of the global-batch loss. Every rank runs the same number of
micro-batches (padding with zero-weight passes) because FSDP2 forward/backward are collectives.
Each optimizer step runs in the update phase of the phase owner (model and optimizer state on the
device, back at rest after).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from tidal.algorithms import Algorithm
from tidal.algorithms.base import LossNormalizer
from tidal.distributed.runtime import Runtime
from tidal.logging.update_split import UpdateSplit
from tidal.models.config import ModelConfig
from tidal.models.loading import critic_values
from tidal.models.logprobs import token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.vision import collate_mm_inputs
from tidal.strategy.base import TrainState
from tidal.run import faults
from tidal.trainer.colocation import Colocation, Models
from tidal.trainer.config import RolloutConfig, TrainConfig, require_resolved
from tidal.trainer.experience import Experience, packed_micro_batches


class MetricMeans:
    """Token-weighted means of per-micro-batch metrics, reduced over ranks on :meth:`result`.

    Device tensors (metrics and weights) are accumulated on the device as they come: the host
    reads them once, in :meth:`result`, so micro-batches never wait for each other's metrics."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor | float] = defaultdict(float)
        self.weights: dict[str, torch.Tensor | float] = defaultdict(float)

    def add(self, metrics: dict[str, torch.Tensor | float], weight: torch.Tensor | float) -> None:
        for k, v in metrics.items():
            v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
            self.sums[k] = self.sums[k] + v * weight
            self.weights[k] = self.weights[k] + weight

    def result(self, runtime: Runtime) -> dict[str, float]:
        keys = sorted(self.sums)
        if not keys:
            return {}
        local = [self.sums[k] for k in keys] + [self.weights[k] for k in keys]
        tensors = [i for i, v in enumerate(local) if isinstance(v, torch.Tensor)]
        if tensors:  # one device-to-host copy for all of them
            host = torch.stack([local[i].reshape(()) for i in tensors]).tolist()
            for i, v in zip(tensors, host):
                local[i] = v
        vals = runtime.all_reduce_sum([float(v) for v in local])
        n = len(keys)
        return {k: vals[i] / vals[n + i] if vals[n + i] > 0 else 0.0 for i, k in enumerate(keys)}


def nonfinite_guard(loss: torch.Tensor, out_BT: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged (value and gradient) when finite; else ``loss + NaN * out_BT.sum()``, whose
    gradient is NaN for every parameter behind the model output ``out_BT``. The clamps in the losses
    turn a NaN loss into zero gradients, which would be applied as a normal step; this way the global
    gradient norm is NaN and every backend's ``optimizer_step`` skips the step on all ranks alike
    (no extra collective, no device sync). With a finite loss the added term is 0 * out_BT.sum(): exactly
    nothing, unless out_BT itself holds NaN/Inf that the loss masked out -- non-finite model outputs, also
    skipped then."""
    scale = torch.where(torch.isfinite(loss.detach()), 0.0, math.nan)
    return loss + scale * out_BT.sum()


def mini_batch_rows(exp: Experience, num_mini_batches: int, generator: torch.Generator) -> list[list[int]]:
    """Rows of each mini-batch: whole groups, shuffled with ``generator``, in equal parts."""
    groups = torch.unique(exp.group_ids_B, sorted=True)
    order = groups[torch.randperm(len(groups), generator=generator)]
    per = len(groups) // num_mini_batches
    parts = []
    for m in range(num_mini_batches):
        chosen = order[m * per : (m + 1) * per]
        parts.append(torch.isin(exp.group_ids_B, chosen).nonzero().flatten().tolist())
    return parts


@dataclasses.dataclass(kw_only=True)
class UpdateResult:
    """What one iteration's updates did: each trained model's metrics, reduced over micro-batches
    and ranks, under the names the algorithm and the optimizer step gave them (``actor``: loss,
    kl, grad_norm, skipped, ...; ``critic``: value_loss, ... or empty without a critic)."""

    actor: dict[str, float]
    critic: dict[str, float]

    def flat(self) -> dict[str, float]:
        """``{"actor/<name>": ..., "critic/<name>": ...}`` for logging; an MoE actor's ``moe/<name>``
        metrics (:class:`tidal.models.moe.MoETraining`) keep their own namespace."""
        return {k if k.startswith("moe/") else f"{role}/{k}": v for role in ("actor", "critic") for k, v in getattr(self, role).items()}


class Updater:
    """Policy (and critic) updates over one rollout's Experience. ``rollout``, ``train``, ``model``
    are the config sections it reads (``rollout.filter``: temperature and filters, ``train.micro_batch_tokens`` /
    ``micro_batch_max_seqs``, ``model.logprob_chunk_tokens``); ``train`` as resolved by the memory
    plan (no ``auto`` budget). ``split`` times the forward, backward and optimizer parts."""

    def __init__(self, *, models: Models, colocation: Colocation, algorithm: Algorithm, rollout: RolloutConfig,
                 train: TrainConfig, model: ModelConfig, split: UpdateSplit):
        self.models = models
        self.split = split
        self.colocation = colocation
        self.algo = algorithm
        self.rollout_cfg = rollout
        require_resolved(train, "train", "micro_batch_tokens")
        self.train_cfg = train
        self.model_cfg = model

    @property
    def runtime(self) -> Runtime:
        return self.colocation.runtime

    def _norm(self, mask_BT: torch.Tensor) -> LossNormalizer:
        tokens, seqs = self.runtime.all_reduce_sum([float(mask_BT.sum()), float((mask_BT.sum(-1) > 0).sum())])
        return LossNormalizer(num_tokens=max(tokens, 1.0), num_seqs=max(seqs, 1.0))

    def _micro_batches(self, exp: Experience) -> tuple[list[list[int]], int]:
        t = self.train_cfg
        batches = packed_micro_batches(exp.attention_mask_BT.sum(-1).tolist(), t.micro_batch_tokens, t.micro_batch_max_seqs,
                                       setting="train.micro_batch_tokens")
        total = int(self.runtime.all_reduce_max([float(len(batches))])[0])
        return batches, total

    def _step(self, state: TrainState, exp: Experience, loss_fn, means: MetricMeans) -> None:
        strategy = self.colocation.strategy
        mask_BT = exp.action_mask_BT * exp.loss_mask_B[:, None]
        norm = self._norm(mask_BT)
        batches, total = self._micro_batches(exp)
        with self.colocation.update(state):
            for i in range(total):
                real = i < len(batches)
                part = exp.select(batches[i] if real else batches[0])
                packed = PackedBatch.build(part.sequences_BT, part.attention_mask_BT, targets_BT=part.action_mask_BT,
                                           cap=self.train_cfg.micro_batch_tokens).to(self.runtime.device)
                mb = part.to(self.runtime.device)
                mb_mask_BT = mb.action_mask_BT * mb.loss_mask_B[:, None]
                with self.split.part("forward"):
                    loss, metrics = loss_fn(mb, packed, mb_mask_BT, norm)
                if real:
                    means.add(metrics, mb_mask_BT.sum().double())
                else:
                    loss = loss * 0.0
                with self.split.part("backward"):
                    strategy.backward(loss, state, sync_grads=i == total - 1)
            with self.split.part("optimizer"):
                step_metrics = strategy.optimizer_step(state)
        means.add(step_metrics, 1.0)

    def _actor_loss(self, mb: Experience, packed: PackedBatch, mask_BT: torch.Tensor, norm: LossNormalizer):
        moe = self.models.moe
        if moe is not None:
            moe.begin(packed, mb.routed_experts_BTLK)
        logp_BT, entropy_BT = token_logprobs(
            self.models.actor.model, mb.sequences_BT, mb.attention_mask_BT,
            sampling=self.rollout_cfg.filter, with_entropy=True, chunk_tokens=self.model_cfg.logprob_chunk_tokens,
            mm_inputs=collate_mm_inputs(mb.mm_inputs, self.runtime.device), entropy_grad=self.algo.entropy_needs_grad,
            packed=packed,  # padding-free; the LM head runs on response tokens only; prompt positions are 0
        )
        logp_BT = faults.corrupt("policy_logp", logp_BT)  # test-only NaN/Inf injection (TIDAL_FAULT)
        # no old logprobs: this is the rollout's only optimizer step, so the actor has not moved since
        # the rollout and its logprobs now are the old ones (train() checks the single step)
        old_logp_BT = mb.old_logp_BT if mb.old_logp_BT is not None else logp_BT.detach()
        loss, metrics = self.algo.policy_loss(
            logp_BT, old_logp_BT, mb.advantages_BT, mask_BT, norm,
            ref_logp_BT=mb.ref_logp_BT, rollout_logp_BT=mb.rollout_logp_BT, entropy_BT=entropy_BT,
        )
        if moe is not None:
            # the load-balancing loss, weighted like the policy loss's token mean: sum over the micro-batches
            # and ranks of one optimizer step = aux_loss_coef x the token-weighted mean of their aux losses
            aux, moe_metrics = moe.after_forward(packed, mb.routed_experts_BTLK)
            if moe.aux_loss_coef > 0:
                loss = loss + moe.aux_loss_coef * aux * (mask_BT.sum() / norm.num_tokens)
            metrics.update({f"moe/{name}": value for name, value in moe_metrics.items()})
        return nonfinite_guard(loss, logp_BT), metrics

    def _critic_loss(self, mb: Experience, packed: PackedBatch, mask_BT: torch.Tensor, norm: LossNormalizer):
        values_BT = critic_values(self.models.critic.model, mb.sequences_BT, mb.attention_mask_BT, packed=packed)
        loss, metrics = self.algo.value_loss(values_BT, mb.values_BT, mb.returns_BT, mask_BT, norm)
        return nonfinite_guard(loss, values_BT), metrics

    def train(self, exp: Experience, *, generator: torch.Generator) -> UpdateResult:
        """``train.epochs`` passes over ``exp`` in ``train.mini_batches`` optimizer steps each."""
        epochs, mini_batches = self.train_cfg.epochs, self.train_cfg.mini_batches
        if exp.old_logp_BT is None and epochs * mini_batches > 1:
            raise ValueError(
                f"the experience has no old logprobs, so it allows one optimizer step, not epochs x mini_batches = "
                f"{epochs} x {mini_batches}; set train.old_logprobs=recompute"
            )
        actor, critic = MetricMeans(), MetricMeans()
        for _ in range(epochs):
            for rows in mini_batch_rows(exp, mini_batches, generator):
                part = exp.select(rows)
                self._step(self.models.actor, part, self._actor_loss, actor)
                if self.models.critic is not None:
                    self._step(self.models.critic, part, self._critic_loss, critic)
        return UpdateResult(actor=actor.result(self.runtime), critic=critic.result(self.runtime))
