"""Policy and critic updates over one rollout's Experience (spec §7 step 9).

The rollout is split into ``mini_batches`` equal parts of whole prompt groups; each part is one
optimizer step, computed in token-budget micro-batches. Loss shares are normalised by the global
counts of the mini-batch (all micro-batches, all ranks), so gradient accumulation and data
parallelism give exactly the gradient of the global-batch loss. Every rank runs the same number of
micro-batches (padding with zero-weight passes) because FSDP2 forward/backward are collectives.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from tidal.algorithms import Algorithm
from tidal.algorithms.base import LossNormalizer
from tidal.models.loading import critic_values
from tidal.models.logprobs import token_logprobs
from tidal.models.vision import collate_mm_inputs
from tidal.strategy.base import Strategy, TrainState
from tidal.trainer import faults
from tidal.trainer.experience import Experience, token_budget_batches


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

    def result(self, strategy: Strategy) -> dict[str, float]:
        keys = sorted(self.sums)
        if not keys:
            return {}
        local = [self.sums[k] for k in keys] + [self.weights[k] for k in keys]
        tensors = [i for i, v in enumerate(local) if isinstance(v, torch.Tensor)]
        if tensors:  # one device-to-host copy for all of them
            host = torch.stack([local[i].reshape(()) for i in tensors]).tolist()
            for i, v in zip(tensors, host):
                local[i] = v
        vals = strategy.all_reduce_sum([float(v) for v in local])
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


class Updater:
    def __init__(
        self, *, strategy: Strategy, actor: TrainState, critic: TrainState | None, algorithm: Algorithm,
        temperature: float, micro_batch_tokens: int, micro_batch_max_seqs: int, logprob_chunk_tokens: int,
        offload_optimizer: bool,
        offload_critic: bool,
    ):
        self.strategy = strategy
        self.actor = actor
        self.critic = critic
        self.algo = algorithm
        self.temperature = temperature
        self.mb_tokens = micro_batch_tokens
        self.mb_seqs = micro_batch_max_seqs
        self.chunk = logprob_chunk_tokens
        self.offload_optimizer = offload_optimizer
        self.offload_critic = offload_critic

    def _norm(self, mask_BT: torch.Tensor) -> LossNormalizer:
        tokens, seqs = self.strategy.all_reduce_sum([float(mask_BT.sum()), float((mask_BT.sum(-1) > 0).sum())])
        return LossNormalizer(num_tokens=max(tokens, 1.0), num_seqs=max(seqs, 1.0))

    def _micro_batches(self, exp: Experience) -> tuple[list[list[int]], int]:
        batches = token_budget_batches(exp.attention_mask_BT.sum(-1).tolist(), self.mb_tokens, self.mb_seqs)
        total = int(self.strategy.all_reduce_max([float(len(batches))])[0])
        return batches, total

    def _step(self, state: TrainState, exp: Experience, loss_fn, means: MetricMeans, prefix: str) -> None:
        mask_BT = exp.action_mask_BT * exp.loss_mask_B[:, None]
        norm = self._norm(mask_BT)
        batches, total = self._micro_batches(exp)
        if self.offload_optimizer:
            self.strategy.reload_optimizer(state)
        for i in range(total):
            real = i < len(batches)
            mb = exp.select(batches[i] if real else batches[0]).to(self.strategy.device)
            mb_mask_BT = mb.action_mask_BT * mb.loss_mask_B[:, None]
            loss, metrics = loss_fn(mb, mb_mask_BT, norm)
            if real:
                means.add({f"{prefix}/{k}": v for k, v in metrics.items()}, mb_mask_BT.sum().double())
            else:
                loss = loss * 0.0
            self.strategy.backward(loss, state, sync_grads=i == total - 1)
        step_metrics = self.strategy.optimizer_step(state)
        if self.offload_optimizer:
            self.strategy.offload_optimizer(state)
        means.add({f"{prefix}/{k}": v for k, v in step_metrics.items()}, 1.0)

    def _actor_loss(self, mb: Experience, mask_BT: torch.Tensor, norm: LossNormalizer):
        logp_BT, entropy_BT = token_logprobs(
            self.actor.model, mb.sequences_BT, mb.attention_mask_BT,
            temperature=self.temperature, with_entropy=True, chunk_tokens=self.chunk,
            mm_inputs=collate_mm_inputs(mb.mm_inputs, self.strategy.device), entropy_grad=self.algo.entropy_needs_grad,
            positions_BT=mb.action_mask_BT,  # the LM head runs on response tokens only; prompt positions are 0
        )
        logp_BT = faults.corrupt("policy_logp", logp_BT)  # test-only NaN/Inf injection (TIDAL_FAULT)
        # no old logprobs: this is the rollout's only optimizer step, so the actor has not moved since
        # the rollout and its logprobs now are the old ones (train() checks the single step)
        old_logp_BT = mb.old_logp_BT if mb.old_logp_BT is not None else logp_BT.detach()
        loss, metrics = self.algo.policy_loss(
            logp_BT, old_logp_BT, mb.advantages_BT, mask_BT, norm,
            ref_logp_BT=mb.ref_logp_BT, rollout_logp_BT=mb.rollout_logp_BT, entropy_BT=entropy_BT,
        )
        return nonfinite_guard(loss, logp_BT), metrics

    def _critic_loss(self, mb: Experience, mask_BT: torch.Tensor, norm: LossNormalizer):
        values_BT = critic_values(self.critic.model, mb.sequences_BT, mb.attention_mask_BT)
        loss, metrics = self.algo.value_loss(values_BT, mb.values_BT, mb.returns_BT, mask_BT, norm)
        return nonfinite_guard(loss, values_BT), metrics

    def _critic_step(self, part: Experience, means: MetricMeans) -> None:
        """The critic's update; with ``offload_critic`` it is on the device only for the step."""
        if self.offload_critic:
            self.strategy.reload_model(self.critic.model)
        self._step(self.critic, part, self._critic_loss, means, "critic")
        if self.offload_critic:
            self.strategy.offload_model(self.critic.model)

    def train(self, exp: Experience, *, epochs: int, mini_batches: int, generator: torch.Generator) -> dict[str, float]:
        if exp.old_logp_BT is None and epochs * mini_batches > 1:
            raise ValueError(
                f"the experience has no old logprobs, so it allows one optimizer step, not epochs x mini_batches = "
                f"{epochs} x {mini_batches}; set train.old_logprobs=recompute"
            )
        means = MetricMeans()
        for _ in range(epochs):
            for rows in mini_batch_rows(exp, mini_batches, generator):
                part = exp.select(rows)
                self._step(self.actor, part, self._actor_loss, means, "actor")
                if self.critic is not None:
                    self._critic_step(part, means)
        return means.result(self.strategy)
