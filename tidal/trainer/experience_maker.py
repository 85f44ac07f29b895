"""ExperienceMaker: prompts -> Experience (spec §7 steps 1-8).

generate (the rollout phase: ``gather_and_generate`` on the awake engine) -> actor old logprobs
(unless the update's forward supplies them: ``Algorithm.reuses_policy_logprobs``) -> reference
logprobs (KL on) -> critic values (estimators with a critic) -> rewards on the responses -> reward
processing and advantages (the algorithm). Where each model sits during its forward is the phase
owner's business (:class:`~tidal.trainer.colocation.Colocation`): this module only says which
phase it enters. Every rank runs every stage for its own prompts, and every model forward runs the
same number of micro-batches on every rank (FSDP2 forwards are collectives), so no rank skips a
collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tidal.algorithms import Algorithm
from tidal.data import PromptItem
from tidal.distributed import gather_and_generate
from tidal.distributed.runtime import Runtime
from tidal.engine.base import Completion, RolloutEngine, SamplingParams
from tidal.logging import PhaseTimer
from tidal.models.config import ModelConfig
from tidal.models.loading import critic_values
from tidal.models.logprobs import token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.vision import collate_mm_inputs
from tidal.rewards import RewardEngine
from tidal.rewards.base import RewardError
from tidal.rewards.types import RewardSample
from tidal.trainer.budget import CompletionBudget
from tidal.trainer.colocation import Colocation, Models
from tidal.trainer.config import RolloutConfig, TrainConfig
from tidal.trainer.experience import Experience, packed_micro_batches


@dataclasses.dataclass(kw_only=True)
class Rollout:
    """Raw generation results of one rank, before any model forward."""

    items: list[PromptItem]
    completions: list[Completion]  # prompt-major, n per item
    group_ids: list[int]


def equalized_count(runtime: Runtime, n_local: int) -> int:
    """The largest micro-batch count over ranks (all ranks must run that many forwards)."""
    return int(runtime.all_reduce_max([float(n_local)])[0])


def run_forward_passes(runtime: Runtime, batches: list[list[int]], fn: Callable[[list[int]], None]) -> None:
    """Call ``fn(idx)`` for each micro-batch, then ``fn(None)`` until this rank has run as many
    passes as the busiest rank. ``fn(None)`` must run a forward (e.g. on the first micro-batch) and
    discard its output: it exists only so every rank enters the same collectives."""
    total = equalized_count(runtime, len(batches))
    for i in range(total):
        fn(batches[i] if i < len(batches) else None)


class ExperienceMaker:
    """Builds one rank's Experience from its prompts (see the module docstring).

    ``rollout``, ``train`` and ``model`` are the run's config sections it reads
    (``rollout.temperature``, ``train.forward_micro_batch_tokens`` / ``_max_seqs``,
    ``model.logprob_chunk_tokens``). Whether the actor's old-logprob pass runs is the algorithm's
    decision (:meth:`Algorithm.reuses_policy_logprobs`).

    ``completion_budget`` (public, None by default): a :class:`~tidal.trainer.budget.CompletionBudget`
    that gives each sequence of a training rollout (:meth:`generate`) its own ``max_new_tokens``, and
    optionally forces its end token there; evaluation is not budgeted. Set it after building the
    trainer: ``trainer.maker.completion_budget = CompletionBudget(lengths=..., end_token_id=...)``."""

    def __init__(self, *, models: Models, phases: Colocation, rewards: RewardEngine, algorithm: Algorithm,
                 rollout: RolloutConfig, train: TrainConfig, model: ModelConfig, timer: PhaseTimer):
        self.models = models
        self.phases = phases
        self.rewards = rewards
        self.algo = algorithm
        self.rollout_cfg = rollout
        self.train_cfg = train
        self.model_cfg = model
        self.timer = timer
        self.old_logprobs_pass = not algorithm.reuses_policy_logprobs(train)
        self.completion_budget: CompletionBudget | None = None

    @property
    def runtime(self) -> Runtime:
        return self.phases.runtime

    # ---- stage 1-3: generation ----------------------------------------------------------------
    def completions(self, engine: RolloutEngine, items: list[PromptItem], params: SamplingParams,
                    budget: CompletionBudget | None = None) -> list[Completion]:
        """This rank's completions of ``items`` (prompt-major, ``params.n`` each) from ``engine``,
        which the caller holds in the rollout phase (``with phases.rollout() as engine``), each
        sequence within its ``budget`` when one is given. Observers get ``generate:done``."""
        budgets = budget.budgets(items, params) if budget is not None else None
        with self.timer.phase("generate"):
            comps = gather_and_generate(
                engine, [it.prompt_ids for it in items], params, self.runtime, mm_inputs=[it.mm_inputs for it in items],
                max_new_tokens=budgets,
            )
        if budget is not None:
            comps = budget.finish(comps, budgets)
        self.timer.event("generate:done", {"prompts": len(items), "completion_lengths": [len(c.token_ids) for c in comps],
                                           "finish_reasons": [c.finish_reason for c in comps]})
        return comps

    def generate(self, items: list[PromptItem], params: SamplingParams, first_group_id: int) -> Rollout:
        """Generate ``params.n`` completions per item; the group id of item i is ``first_group_id + i``."""
        with self.phases.rollout() as engine:
            completions = self.completions(engine, items, params, self.completion_budget)
        group_ids = [first_group_id + i for i in range(len(items)) for _ in range(params.n)]
        return Rollout(items=items, completions=completions, group_ids=group_ids)

    # ---- tensors ---------------------------------------------------------------------------------
    def _pack(self, rollout: Rollout) -> dict:
        """Right-padded [B, T] tensors of prompt + response, and ``mm_inputs``: each row's prompt
        images (None for a text row), or None when no row has images."""
        comps = rollout.completions
        pad = self.models.tokenizer.pad_token_id or 0
        lens = [len(c.prompt_ids) + len(c.token_ids) for c in comps]
        B, T = len(comps), max(lens)
        seq_BT = torch.full((B, T), pad, dtype=torch.long)
        attn_BT = torch.zeros((B, T), dtype=torch.long)
        act_BT = torch.zeros((B, T), dtype=torch.float32)
        rlogp_BT = torch.zeros((B, T), dtype=torch.float32)
        for b, c in enumerate(comps):
            P, R = len(c.prompt_ids), len(c.token_ids)
            seq_BT[b, :P] = torch.tensor(c.prompt_ids)
            seq_BT[b, P : P + R] = torch.tensor(c.token_ids, dtype=torch.long)
            attn_BT[b, : P + R] = 1
            act_BT[b, P : P + R] = 1
            rlogp_BT[b, P : P + R] = torch.tensor(c.logprobs, dtype=torch.float32)
        n = len(comps) // max(1, len(rollout.items))
        mm = [rollout.items[b // n].mm_inputs for b in range(B)]
        return {"sequences_BT": seq_BT, "attention_mask_BT": attn_BT, "action_mask_BT": act_BT, "rollout_logp_BT": rlogp_BT,
                "mm_inputs": mm if any(m is not None for m in mm) else None}

    @torch.no_grad()
    def _per_token(self, forward, t: dict[str, torch.Tensor], batches: list[list[int]]) -> torch.Tensor:
        """Run ``forward(ids_BT, mask_BT, packed, mm_inputs) -> x_BT`` over the packed micro-batches
        (equal pass counts on every rank) and scatter the results into one [B, T] tensor, zero off the
        actions."""
        out_BT = torch.zeros_like(t["rollout_logp_BT"])
        dev = self.runtime.device

        def fn(idx):
            real = idx is not None
            idx = idx if real else batches[0]
            T = int(t["attention_mask_BT"][idx].sum(-1).max())
            ids, am = t["sequences_BT"][idx, :T], t["attention_mask_BT"][idx, :T]
            packed = PackedBatch.build(ids, am, targets_BT=t["action_mask_BT"][idx, :T],
                                       cap=self.train_cfg.forward_micro_batch_tokens).to(dev)
            mm = collate_mm_inputs([t["mm_inputs"][i] for i in idx] if t["mm_inputs"] else None, dev)
            x_BT = forward(ids.to(dev), am.to(dev), packed, mm)
            if real:
                out_BT[idx, :T] = x_BT.float().cpu()

        run_forward_passes(self.runtime, batches, fn)
        return out_BT * t["action_mask_BT"]

    def _logprobs(self, model: torch.nn.Module, t: dict[str, torch.Tensor], batches: list[list[int]],
                  temperature: float | None = None) -> torch.Tensor:
        """``model``'s logprobs of the sampled tokens, at ``temperature`` (default: the rollout's)."""
        temp = self.rollout_cfg.temperature if temperature is None else temperature

        def forward(ids, am, packed, mm):  # the LM head runs on the response tokens only
            return token_logprobs(model, ids, am, temperature=temp, chunk_tokens=self.model_cfg.logprob_chunk_tokens,
                                  mm_inputs=mm, packed=packed)[0]

        with self.phases.using(model):
            return self._per_token(forward, t, batches)

    def _values(self, critic: torch.nn.Module, t: dict[str, torch.Tensor], batches: list[list[int]]) -> torch.Tensor:
        with self.phases.using(critic):
            return self._per_token(lambda ids, am, packed, mm: critic_values(critic, ids, am, packed=packed), t, batches)

    # ---- stage 4-8 ---------------------------------------------------------------------------------
    def score(self, rollout: Rollout):
        samples = []
        n = len(rollout.completions) // max(1, len(rollout.items))
        # one call for the whole rollout (a fast tokenizer decodes the batch natively)
        texts = self.models.tokenizer.batch_decode([c.token_ids for c in rollout.completions], skip_special_tokens=True)
        for i, (c, text) in enumerate(zip(rollout.completions, texts)):
            item = rollout.items[i // n]
            samples.append(
                RewardSample(
                    prompt=item.prompt_text,
                    response=text,
                    prompt_ids=list(c.prompt_ids),
                    response_ids=list(c.token_ids),
                    reference=item.reference,
                    label=item.label,
                    metadata=item.metadata,
                    finish_reason=c.finish_reason,
                    index=i,
                )
            )
        return samples, self.rewards.score(samples)

    def make(self, rollout: Rollout) -> tuple[Experience, dict[str, float], list[RewardSample]]:
        """Run stages 4-8 on a rollout; returns the Experience (on CPU), rollout metrics, and the
        reward samples (for trajectory logging). Without ``old_logprobs_pass`` the Experience has no
        old logprobs (the update's forward supplies them), and the metrics that compare them with
        the rollout's and the reference's (``mismatch/*``, ``kl/rollout``) are left out: the update
        reports the same comparisons as ``actor/mismatch_*`` and ``actor/kl``."""
        t = self._pack(rollout)
        lengths = t["attention_mask_BT"].sum(-1).tolist()
        batches = packed_micro_batches(lengths, self.train_cfg.forward_micro_batch_tokens, self.train_cfg.forward_micro_batch_max_seqs,
                                       setting="train.forward_micro_batch_tokens")
        m = self.models
        old_logp_BT = ref_logp_BT = values_BT = None
        if self.old_logprobs_pass:
            with self.timer.phase("actor_logprobs"):
                old_logp_BT = self._logprobs(m.actor.model, t, batches)
        if m.reference is not None:
            with self.timer.phase("reference_logprobs"):
                ref_logp_BT = self._logprobs(m.reference, t, batches)
        if m.critic is not None:
            with self.timer.phase("critic_values"):
                values_BT = self._values(m.critic.model, t, batches)
        teacher_logp_BT, teacher_ok_B, teacher_metrics = None, None, {}
        if self.algo.needs_teacher:
            with self.timer.phase("teacher_logprobs"):
                teacher_logp_BT, teacher_ok_B, teacher_metrics = self._teacher_logprobs(rollout, t, batches)
        with self.timer.phase("reward"):
            samples, rew = self.score(rollout)
        action_BT = t["action_mask_BT"]
        truncated_B = torch.tensor([c.finish_reason == "length" for c in rollout.completions])
        group_ids_B = torch.tensor(rollout.group_ids, dtype=torch.long)
        with self.timer.phase("advantages"):
            adv = self.algo.advantages(
                total_B=rew.total_B.float(), action_mask_BT=action_BT, group_ids_B=group_ids_B, truncated_B=truncated_B,
                old_logp_BT=old_logp_BT, ref_logp_BT=ref_logp_BT, values_BT=values_BT,
                student_logp_BT=old_logp_BT if old_logp_BT is not None else t["rollout_logp_BT"],
                teacher_logp_BT=teacher_logp_BT,
            )
        loss_mask_B = rew.valid_B.float() * self.algo.loss_mask_B(truncated_B).float()
        if teacher_ok_B is not None:
            loss_mask_B = loss_mask_B * teacher_ok_B.float()
        exp = Experience(
            sequences_BT=t["sequences_BT"], attention_mask_BT=t["attention_mask_BT"], action_mask_BT=action_BT,
            old_logp_BT=old_logp_BT, rollout_logp_BT=t["rollout_logp_BT"], ref_logp_BT=ref_logp_BT,
            values_BT=values_BT, advantages_BT=adv.advantages_BT, returns_BT=adv.returns_BT,
            rewards_B=adv.rewards_B, group_ids_B=group_ids_B, loss_mask_B=loss_mask_B, mm_inputs=t["mm_inputs"],
        )
        metrics = self._metrics(exp, rew, truncated_B, adv.kl_BT)
        metrics.update(adv.metrics)
        metrics.update(teacher_metrics)
        return exp, metrics, samples

    def _teacher_logprobs(self, rollout: Rollout, t: dict, batches: list[list[int]]):
        """The teacher's logprobs of the sampled tokens (temperature 1: the teacher's own
        distribution), the rows it scored, and its metrics. A local teacher is a frozen model's
        forward; a remote one's failed sequences follow ``reward.on_error``: ``raise`` names the
        teacher and the sample, ``drop`` leaves the sample out of the loss and counts it."""
        m = self.models
        B = len(rollout.completions)
        if m.teacher is not None:
            return self._logprobs(m.teacher, t, batches, temperature=1.0), torch.ones(B, dtype=torch.bool), {}
        comps = rollout.completions
        lps, errors, counters = m.remote_teacher.token_logprobs([c.prompt_ids for c in comps], [c.token_ids for c in comps])
        if errors and self.rewards.cfg.on_error == "raise":
            i = min(errors)
            more = f" ({len(errors) - 1} more samples failed)" if len(errors) > 1 else ""
            raise RewardError(f"distillation teacher failed on sample {i}: {errors[i]}{more}")
        out_BT = torch.zeros_like(t["rollout_logp_BT"])
        ok_B = torch.ones(B, dtype=torch.bool)
        for b, (c, lp) in enumerate(zip(comps, lps)):
            if lp is None:
                ok_B[b] = False
                continue
            P = len(c.prompt_ids)
            out_BT[b, P : P + len(lp)] = torch.tensor(lp, dtype=torch.float32)
        metrics = {"distill/teacher_dropped": float(len(errors)), **{f"distill/teacher_{k}": v for k, v in counters.items()}}
        return out_BT, ok_B, metrics

    def _metrics(self, exp: Experience, rew, truncated_B: torch.Tensor, kl_BT) -> dict[str, float]:
        act = exp.action_mask_BT
        ntok = act.sum().clamp_min(1)
        m = {
            "reward/mean": float(rew.total_B.float().mean()),
            "response/length_mean": float(exp.response_len_B.float().mean()),
            "response/length_max": float(exp.response_len_B.float().max()),
            "response/truncated_frac": float(truncated_B.float().mean()),
            "advantage/mean": float((exp.advantages_BT * act).sum() / ntok),
            "advantage/std": float(exp.advantages_BT[act.bool()].std()) if act.sum() > 1 else 0.0,
        }
        if exp.old_logp_BT is not None:
            diff_BT = (exp.old_logp_BT - exp.rollout_logp_BT) * act
            m["mismatch/abs_logp_diff_mean"] = float(diff_BT.abs().sum() / ntok)
            m["mismatch/logp_diff_max"] = float(diff_BT.abs().max())
        if kl_BT is not None:
            m["kl/rollout"] = float(kl_BT.sum() / ntok)
        if exp.values_BT is not None:
            m["critic/value_mean"] = float((exp.values_BT * act).sum() / ntok)
        for k, v in rew.metrics.items():
            m[k if "/" in k else f"reward/{k}"] = float(v)
        return m
