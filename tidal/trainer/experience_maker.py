"""ExperienceMaker: prompts -> Experience (spec §7 steps 1-8).

generate (the rollout phase: the environment's trajectories, :class:`~tidal.envs.EnvRollout`,
decoded by the awake engine through :class:`~tidal.distributed.generate.GroupGenerator`) -> actor
old logprobs (unless the update's forward supplies them: ``Algorithm.reuses_policy_logprobs``) ->
reference logprobs (KL on) -> critic values (estimators with a critic) -> rewards on the
trajectories (each group handed to a :class:`~tidal.rewards.stream.RewardStream` as its last
trajectory ends, so scoring overlaps the rest of the rollout and the forwards) -> reward
processing and advantages (the algorithm). Where each model sits during its
forward is the phase owner's business (:class:`~tidal.trainer.colocation.Colocation`): this module
only says which phase it enters.

One rollout path: every rollout is a set of trajectories of the configured environment
(``env.*``). The default ``single_turn`` environment is the one-turn case: one engine call with
each prompt's ids and the sampler's parameters, one row per completion, the same tensors and
metrics as a plain rollout. A multi-turn environment gives rows whose action mask has gaps (the
observations), per-turn rewards, and (``env.history: template``) trajectories over several rows.

Collectives: in a rollout TP group every rank takes part in every engine call (the generator's
rounds, whatever the ranks' numbers of turns); across ranks every model forward runs the same
number of micro-batches (FSDP2 forwards are collectives), also when the ranks hold different
numbers of rows, so no rank skips a collective.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from tidal.algorithms import Algorithm
from tidal.data import PromptItem
from tidal.distributed.generate import GroupGenerator
from tidal.distributed.runtime import Runtime
from tidal.engine.base import RolloutEngine, SamplingParams
from tidal.engine.native.speculative.metrics import speculation_metrics
from tidal.envs import EnvConfig, EnvRollout, EnvRow, PackedRows, RolloutResult, Trajectory, pack_trajectories
from tidal.logging import PhaseTimer
from tidal.models.config import ModelConfig
from tidal.models.loading import critic_values
from tidal.models.logprobs import token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.vision import collate_mm_inputs
from tidal.rewards import RewardEngine
from tidal.rewards.base import RewardError
from tidal.rewards.config import RewardConfig
from tidal.rewards.stream import RewardStream
from tidal.sampling_filter import SamplingFilter
from tidal.rewards.types import RewardSample
from tidal.trainer.budget import CompletionBudget
from tidal.trainer.colocation import Colocation, Models
from tidal.trainer.config import RolloutConfig, TrainConfig, require_resolved
from tidal.trainer.experience import Experience, packed_micro_batches
from tidal.trainer.partial import LongTailRollout


@dataclasses.dataclass(kw_only=True)
class Rollout:
    """Raw generation results of one rank, before any model forward.

    trajectories: prompt-major, ``params.n`` per item; those of item i share group id
        ``first_group_id + i``.
    metrics: the environment's ``env/*`` metrics (:class:`~tidal.envs.RolloutResult`); empty for
        ``single_turn``, whose rollouts report exactly what a plain rollout reports.
    scoring: the rewards scored while it was generated (each group as its last trajectory ended),
        which :meth:`ExperienceMaker.score` completes; None: scored at the end.
    """

    items: list[PromptItem]
    trajectories: list[Trajectory]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    scoring: RewardStream | None = None


class GroupScoring:
    """The ``on_trajectory`` callback that feeds a :class:`~tidal.rewards.stream.RewardStream` one group
    at a time: the ``n`` trajectories at positions ``g*n .. g*n+n-1`` when the last of them ends,
    each as the sample it will be in :meth:`ExperienceMaker.score` when every trajectory has a turn
    (``index`` = its position); a trajectory without a turn is left to the end."""

    def __init__(self, stream: RewardStream, n: int):
        self.stream, self.n = stream, n
        self.ended: dict[int, dict[int, Trajectory]] = {}

    def __call__(self, i: int, trajectory: Trajectory) -> None:
        group = self.ended.setdefault(i // self.n, {})
        group[i] = trajectory
        if len(group) < self.n:
            return
        del self.ended[i // self.n]
        scored = sorted(j for j, t in group.items() if t.turns)
        self.stream.submit(scored, [group[j].reward_sample(j) for j in scored])


@dataclasses.dataclass(kw_only=True)
class Scores:
    """Rewards of N trajectories.

    total_N: the RewardEngine's total plus the environment's outcome reward (0 when not scored).
    valid_N: enters the loss: scored, its reward not dropped, and the environment kept it.
    env_ok_N: the environment kept it (it has a turn; no environment error or dropped tool failure).
    samples: what each trajectory was scored on (None for one without any turn).
    metrics: the RewardEngine's metrics.
    """

    total_N: torch.Tensor
    valid_N: torch.Tensor
    env_ok_N: torch.Tensor
    samples: list[RewardSample | None]
    metrics: dict[str, float]

    def correct_N(self, threshold: float) -> torch.Tensor:
        """Counted correct in evaluation: total reward >= ``threshold`` and kept by the environment."""
        return (self.total_N >= threshold) & self.env_ok_N


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

    ``rollout``, ``train``, ``model``, ``env`` and ``reward`` are the run's config sections it reads
    (``rollout.temperature``, ``train.forward_micro_batch_tokens`` / ``_max_seqs``,
    ``model.logprob_chunk_tokens``, the environment and its limits, ``reward.on_error`` for a remote
    teacher's failed rows); ``train`` as resolved by the memory plan (no ``auto`` budget). The
    models are those of ``colocation`` (the placement owner), which places them for each pass. Whether the actor's
    old-logprob pass runs is the algorithm's decision (:meth:`Algorithm.reuses_policy_logprobs`).
    Its stages are timed on the phase owner's timer.

    ``completion_budget`` (public, None by default): a :class:`~tidal.trainer.budget.CompletionBudget`
    that gives each sequence of a single-turn training rollout (:meth:`generate`) its own
    ``max_new_tokens``, and optionally forces its end token there; evaluation is not budgeted. Set it
    after building the trainer: ``trainer.maker.completion_budget = CompletionBudget(lengths=..., end_token_id=...)``."""

    def __init__(self, *, colocation: Colocation, rewards: RewardEngine, algorithm: Algorithm,
                 rollout: RolloutConfig, train: TrainConfig, model: ModelConfig, env: EnvConfig, reward: RewardConfig):
        self.models: Models = colocation.models
        self.colocation = colocation
        self.rewards = rewards
        self.algo = algorithm
        self.rollout_cfg = rollout
        require_resolved(train, "train", "forward_micro_batch_tokens")
        self.train_cfg = train
        self.model_cfg = model
        self.reward_cfg = reward
        self.timer: PhaseTimer = colocation.timer
        self.old_logprobs_pass = not algorithm.reuses_policy_logprobs(train)
        self.completion_budget: CompletionBudget | None = None
        # builds one environment now: bad env.kwargs fail at setup; trajectories end where the model's context does
        self.env = EnvRollout(env, self.models.tokenizer, max_context=self.models.positions)
        self.multi_turn = env.name != "single_turn"

    @property
    def runtime(self) -> Runtime:
        return self.colocation.runtime

    # ---- stage 1-3: generation ----------------------------------------------------------------
    def trajectories(self, engine: RolloutEngine, items: list[PromptItem], params: SamplingParams,
                     first_group_id: int = 0, budget: CompletionBudget | None = None,
                     scoring: RewardStream | None = None) -> RolloutResult:
        """This rank's trajectories of ``items`` (prompt-major, ``params.n`` each) from ``engine``,
        which the caller holds in the rollout phase (``with colocation.rollout() as engine``), each
        sequence within its ``budget`` when one is given. Every rank of a rollout TP group calls
        this with its own items (possibly none). Each group goes to ``scoring`` when its last
        trajectory ends. Observers get ``generate:done``."""
        rows = [EnvRow.from_prompt_item(it) for it in items]
        budgets = budget.budgets(items, params) if budget is not None else None
        with self.timer.phase("generate"):
            result = self.env.run(GroupGenerator(engine, self.runtime), rows, params, first_group_id=first_group_id,
                                  budgets=budgets, end_token_id=budget.end_token_id if budget is not None else None,
                                  on_trajectory=GroupScoring(scoring, params.n) if scoring is not None else None)
        self.timer.event("generate:done", {"prompts": len(items),
                                           "completion_lengths": [t.num_sampled_tokens for t in result.trajectories],
                                           "finish_reasons": [t.turns[-1].finish_reason if t.turns else None  # the engine's stop / length
                                                              for t in result.trajectories]})
        return result

    def generate(self, items: list[PromptItem], params: SamplingParams, first_group_id: int) -> Rollout:
        """Generate ``params.n`` trajectories per item; the group id of item i is ``first_group_id + i``.
        Metrics: the environment's (multi-turn) and the engine's ``rollout/spec_*`` (speculation)."""
        scoring = RewardStream(self.rewards)  # each group scored as it ends, while the others decode
        try:
            with self.colocation.rollout() as engine, speculation_metrics(engine) as spec:
                result = self.trajectories(engine, items, params, first_group_id, self.completion_budget, scoring)
        except BaseException:
            scoring.close()
            raise
        return Rollout(items=items, trajectories=result.trajectories,
                       metrics={**(result.metrics if self.multi_turn else {}), **spec}, scoring=scoring)

    def generate_partial(self, long_tail: LongTailRollout, step: int, params: SamplingParams) -> Rollout:
        """Step ``step``'s rollout under ``rollout.partial`` (:mod:`tidal.trainer.partial`): the
        groups it trains, as single-turn trajectories, with the ``partial/*`` metrics."""
        with self.colocation.rollout() as engine, self.timer.phase("generate"), speculation_metrics(engine) as spec:
            trained, metrics, _ = long_tail.collect(engine, step, params, self.completion_budget)
        metrics.update(spec)
        items, trajectories = long_tail.trajectories(trained, self.env.renderer.decode_batch)
        self.timer.event("generate:done", {"prompts": len(items),
                                           "completion_lengths": [t.num_sampled_tokens for t in trajectories],
                                           "finish_reasons": [t.turns[-1].finish_reason for t in trajectories]})
        return Rollout(items=items, trajectories=trajectories, metrics=metrics)

    # ---- tensors ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _per_token(self, forward, rows: PackedRows, batches: list[list[int]]) -> torch.Tensor:
        """Run ``forward(ids_BT, mask_BT, packed, mm_inputs) -> x_BT`` over the packed micro-batches
        of ``rows`` (equal pass counts on every rank) and scatter the results into one [B, T]
        tensor, zero off the actions."""
        out_BT = torch.zeros_like(rows.rollout_logp_BT)
        dev = self.runtime.device

        def fn(idx):
            real = idx is not None
            idx = idx if real else batches[0]
            T = int(rows.attention_mask_BT[idx].sum(-1).max())
            ids, am = rows.sequences_BT[idx, :T], rows.attention_mask_BT[idx, :T]
            packed = PackedBatch.build(ids, am, targets_BT=rows.action_mask_BT[idx, :T],
                                       cap=self.train_cfg.forward_micro_batch_tokens).to(dev)
            mm = collate_mm_inputs([rows.mm_inputs[i] for i in idx] if rows.mm_inputs else None, dev)
            if self.models.moe is not None:  # the actor's routers replay the engine's routing (moe.routing_replay)
                self.models.moe.begin(packed, rows.routed_BTLK[idx, :T] if rows.routed_BTLK is not None else None)
            x_BT = forward(ids.to(dev), am.to(dev), packed, mm)
            if real:
                out_BT[idx, :T] = x_BT.float().cpu()

        run_forward_passes(self.runtime, batches, fn)
        return out_BT * rows.action_mask_BT

    def _logprobs(self, model: torch.nn.Module, rows: PackedRows, batches: list[list[int]],
                  sampling: SamplingFilter | None = None) -> torch.Tensor:
        """``model``'s logprobs of the sampled tokens under ``sampling`` (default: the rollout's
        processed distribution, ``rollout.filter``: the actor's old logprobs and the reference's,
        so that the rollout/old ratio and the KL to the reference are 1 and 0 where the weights agree)."""
        dist = self.rollout_cfg.filter if sampling is None else sampling

        def forward(ids, am, packed, mm):  # the LM head runs on the response tokens only
            return token_logprobs(model, ids, am, sampling=dist, chunk_tokens=self.model_cfg.logprob_chunk_tokens,
                                  mm_inputs=mm, packed=packed)[0]

        with self.colocation.using(model):
            return self._per_token(forward, rows, batches)

    def _values(self, critic: torch.nn.Module, rows: PackedRows, batches: list[list[int]]) -> torch.Tensor:
        with self.colocation.using(critic):
            return self._per_token(lambda ids, am, packed, mm: critic_values(critic, ids, am, packed=packed), rows, batches)

    # ---- stage 4-8 ---------------------------------------------------------------------------------
    def score(self, trajectories: list[Trajectory], scoring: RewardStream | None = None) -> Scores:
        """Score the trajectories with a turn in one RewardEngine call (each on its final turn, with
        the whole conversation in ``RewardSample.messages``) and add the environment's outcome rewards.
        ``scoring``: what was scored while they were generated; the result is the same."""
        N = len(trajectories)
        scored = [i for i, t in enumerate(trajectories) if t.turns]
        batch = [trajectories[i].reward_sample(k) for k, i in enumerate(scored)]
        rew = scoring.results(batch) if scoring is not None else self.rewards.score(batch)
        total_N = torch.zeros(N, dtype=torch.float32)
        valid_N = torch.zeros(N, dtype=torch.bool)
        idx = torch.tensor(scored, dtype=torch.long)
        total_N[idx] = rew.total_B.float()
        valid_N[idx] = rew.valid_B
        outcome_N = torch.tensor([t.outcome_reward for t in trajectories], dtype=torch.float32)
        env_ok_N = torch.tensor([t.valid and bool(t.turns) for t in trajectories], dtype=torch.bool)
        if outcome_N.any():  # dropped rewards stay 0
            total_N = total_N + torch.where(valid_N, outcome_N, torch.zeros_like(outcome_N))
        samples: list[RewardSample | None] = [None] * N
        for k, i in enumerate(scored):
            samples[i] = batch[k]
        return Scores(total_N=total_N, valid_N=valid_N & env_ok_N, env_ok_N=env_ok_N, samples=samples, metrics=rew.metrics)

    def make(self, rollout: Rollout) -> tuple[Experience, dict[str, float], list[RewardSample | None]]:
        """Run stages 4-8 on a rollout; returns the Experience (on CPU), rollout metrics, and the
        reward sample of each row (for trajectory logging; None for a trajectory without a turn).
        Without ``old_logprobs_pass`` the Experience has no old logprobs (the update's forward
        supplies them), and the metrics that compare them with the rollout's and the reference's
        (``mismatch/*``, ``kl/rollout``) are left out: the update reports the same comparisons as
        ``actor/mismatch_*`` and ``actor/kl``."""
        packed = pack_trajectories(rollout.trajectories, self.models.tokenizer.pad_token_id or 0)
        lengths = packed.attention_mask_BT.sum(-1).tolist()
        batches = packed_micro_batches(lengths, self.train_cfg.forward_micro_batch_tokens, self.train_cfg.forward_micro_batch_max_seqs,
                                       setting="train.forward_micro_batch_tokens")
        m = self.models
        old_logp_BT = ref_logp_BT = values_BT = None
        if self.old_logprobs_pass:
            with self.timer.phase("actor_logprobs"):
                old_logp_BT = self._logprobs(m.actor.model, packed, batches)
        if m.reference is not None:
            with self.timer.phase("reference_logprobs"):
                ref_logp_BT = self._logprobs(m.reference, packed, batches)
        if m.critic is not None:
            with self.timer.phase("critic_values"):
                values_BT = self._values(m.critic.model, packed, batches)
        teacher_logp_BT, teacher_ok_B, teacher_metrics = None, None, {}
        if self.algo.needs_teacher:
            with self.timer.phase("teacher_logprobs"):
                teacher_logp_BT, teacher_ok_B, teacher_metrics = self._teacher_logprobs(packed, batches)
        with self.timer.phase("reward"):
            scores = self.score(rollout.trajectories, rollout.scoring)
        trajs = rollout.trajectories
        action_BT = packed.action_mask_BT
        truncated_B = packed.per_row(torch.tensor([tr.truncated for tr in trajs], dtype=torch.bool))
        response_len_B = None  # single turn: the sampled tokens of the row
        if self.multi_turn:  # the trajectory's budget: sampled and observation tokens (env.max_total_tokens)
            response_len_B = packed.per_row(torch.tensor([float(tr.num_response_tokens) for tr in trajs]))
        group_ids_B = packed.group_ids_B
        with self.timer.phase("advantages"):
            adv = self.algo.advantages(
                total_B=packed.per_row(scores.total_N), action_mask_BT=action_BT, group_ids_B=group_ids_B,
                truncated_B=truncated_B, old_logp_BT=old_logp_BT, ref_logp_BT=ref_logp_BT, values_BT=values_BT,
                student_logp_BT=old_logp_BT if old_logp_BT is not None else packed.rollout_logp_BT,
                teacher_logp_BT=teacher_logp_BT,
                token_rewards_BT=packed.token_rewards_BT if packed.token_rewards_BT.any() else None,
                trajectory_ids_B=packed.advantage_trajectory_ids(), response_len_B=response_len_B,
            )
        loss_mask_B = packed.per_row(scores.valid_N).float() * self.algo.loss_mask_B(truncated_B).float()
        if teacher_ok_B is not None:
            loss_mask_B = loss_mask_B * teacher_ok_B.float()
        exp = Experience(
            sequences_BT=packed.sequences_BT, attention_mask_BT=packed.attention_mask_BT, action_mask_BT=action_BT,
            old_logp_BT=old_logp_BT, rollout_logp_BT=packed.rollout_logp_BT, ref_logp_BT=ref_logp_BT,
            values_BT=values_BT, advantages_BT=adv.advantages_BT, returns_BT=adv.returns_BT,
            rewards_B=adv.rewards_B, group_ids_B=group_ids_B, loss_mask_B=loss_mask_B, mm_inputs=packed.mm_inputs,
            routed_experts_BTLK=packed.routed_BTLK,
        )
        metrics = self._metrics(exp, packed, scores, adv.kl_BT)
        metrics.update(adv.metrics)
        metrics.update(teacher_metrics)
        metrics.update(rollout.metrics)
        return exp, metrics, packed.row_list(scores.samples)

    def _teacher_logprobs(self, packed: PackedRows, batches: list[list[int]]):
        """The teacher's logprobs of the sampled tokens (temperature 1: the teacher's own
        distribution), the rows it scored, and its metrics. A local teacher is a frozen model's
        forward; a remote one scores each row's tokens after its prompt (observations included, as
        context) and its failed rows follow ``reward.on_error``: ``raise`` names the teacher and the
        row, ``drop`` leaves the row out of the loss and counts it."""
        m = self.models
        B = packed.sequences_BT.shape[0]
        if m.teacher is not None:
            return self._logprobs(m.teacher, packed, batches, sampling=SamplingFilter()), torch.ones(B, dtype=torch.bool), {}
        rows = [r for tr in packed.trajectories for r in tr.rows]
        asked = [b for b, r in enumerate(rows) if r.token_ids]  # a row without a turn has nothing to score
        lps, errors, counters = m.remote_teacher.token_logprobs([rows[b].prompt_ids for b in asked],
                                                                [rows[b].token_ids for b in asked])
        if errors and self.reward_cfg.on_error == "raise":
            i = min(errors)
            more = f" ({len(errors) - 1} more samples failed)" if len(errors) > 1 else ""
            raise RewardError(f"distillation teacher failed on sample {asked[i]}: {errors[i]}{more}")
        out_BT = torch.zeros_like(packed.rollout_logp_BT)
        ok_B = torch.ones(B, dtype=torch.bool)
        for b, lp in zip(asked, lps):
            if lp is None:
                ok_B[b] = False
                continue
            P = len(rows[b].prompt_ids)
            out_BT[b, P : P + len(lp)] = torch.tensor(lp, dtype=torch.float32)
        metrics = {"distill/teacher_dropped_count": float(len(errors)), **{f"distill/teacher_{k}_count": v for k, v in counters.items()}}
        return out_BT * packed.action_mask_BT, ok_B, metrics

    def _metrics(self, exp: Experience, packed: PackedRows, scores: Scores, kl_BT) -> dict[str, float]:
        """Rollout metrics. Rewards, lengths (sampled tokens) and truncation are per trajectory; the
        advantage, mismatch and KL statistics per sampled token."""
        act = exp.action_mask_BT
        ntok = act.sum().clamp_min(1)
        N = len(packed.trajectories)
        len_N = torch.zeros(N, dtype=torch.float32).index_add_(0, packed.trajectory_ids_B, exp.response_len_B.float())
        truncated_N = torch.tensor([t.truncated for t in packed.trajectories], dtype=torch.bool)
        valid_N = scores.total_N[scores.valid_N]  # the trained rewards' range (-inf/inf: none here)
        m = {
            "reward/mean": float(scores.total_N.mean()),
            "reward/trajectory_max": float(valid_N.max()) if valid_N.numel() else -math.inf,
            "reward/trajectory_min": float(valid_N.min()) if valid_N.numel() else math.inf,
            "response/length_mean": float(len_N.mean()),
            "response/length_max": float(len_N.max()),
            "response/tokens_count": float(act.sum()),  # sampled tokens (summed over ranks)
            "response/truncated_frac": float(truncated_N.float().mean()),
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
        for k, v in scores.metrics.items():
            m[k if "/" in k else f"reward/{k}"] = float(v)
        return m
