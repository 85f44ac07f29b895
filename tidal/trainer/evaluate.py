"""Evaluation on held-out prompts: greedy reward and accuracy, sampled mean@k and pass@k, over ALL ranks.

Accuracy (``greedy_accuracy``, ``pass@k``: total reward >= ``eval.correct_threshold``) is reported
only when every reward component judges right or wrong (a rule or a function,
:attr:`~tidal.rewards.config.RewardConfig.judges_correctness`); with a reward model or a remote
service the total reward is a score, and only the mean rewards (``greedy_reward``, ``mean@k``) are.

Uses the same rollout path (the configured environment, ``env.*``) and reward chain as training
but builds no Experience for training, updates no parameters, and leaves training statistics
(reward normalisers, the sampler, RNG streams of training) untouched: sampling here uses its own
seeded generator. With a multi-turn environment it also reports the greedy trajectories'
environment metrics (``eval/env/*``: turns, tool calls, finish reasons, ... averaged over
trajectories).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from tidal.data import PromptItem
from tidal.engine.base import SamplingParams
from tidal.envs import RolloutResult
from tidal.distributed.runtime import Runtime
from tidal.rewards.base import SyncComponent
from tidal.trainer.colocation import Colocation, Models
from tidal.trainer.config import EvalConfig, TrainerSections
from tidal.trainer.experience_maker import ExperienceMaker, Scores

# Rollout metrics that are not averages over trajectories (they are not reported for evaluation).
_NOT_PER_TRAJECTORY = ("env/generate_calls", "env/generate_s", "env/wait_s")


@dataclasses.dataclass(kw_only=True)
class EvalSums:
    """Sums over this rank's prompts; all-reduced before dividing."""

    prompts: float = 0.0
    greedy_reward: float = 0.0
    greedy_correct: float = 0.0
    sampled_reward: float = 0.0
    pass_at_k: float = 0.0
    greedy_length: float = 0.0


def evaluate(
    maker: ExperienceMaker,
    items: list[PromptItem],
    cfg: EvalConfig,
    *,
    max_new_tokens: int,
    seed: int,
) -> dict[str, float]:
    """Evaluate this rank's shard ``items``; returns metrics reduced over all ranks. Generation goes
    through the same rollout phase as training; rewards are scored after it (engine asleep)."""
    s = EvalSums(prompts=float(len(items)))
    greedy = sampled = None
    with maker.colocation.rollout() as engine:
        if cfg.greedy:
            greedy = maker.trajectories(engine, items, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, n=1))
        if cfg.n_samples > 0:
            params = SamplingParams(temperature=cfg.temperature, max_new_tokens=max_new_tokens, n=cfg.n_samples, seed=seed)
            sampled = maker.trajectories(engine, items, params)
    greedy_scores = None
    if greedy is not None and items:
        scores = greedy_scores = maker.score(greedy.trajectories)
        s.greedy_reward = float(scores.total_N.sum())
        s.greedy_correct = float(scores.correct_N(cfg.correct_threshold).sum())
        s.greedy_length = float(sum(t.num_sampled_tokens for t in greedy.trajectories))
    if sampled is not None and items:
        scores = maker.score(sampled.trajectories)
        total_PK = scores.total_N.view(len(items), cfg.n_samples)
        s.sampled_reward = float(total_PK.mean(-1).sum())
        s.pass_at_k = float(scores.correct_N(cfg.correct_threshold).view(len(items), cfg.n_samples).any(-1).float().sum())
    fields = [f.name for f in dataclasses.fields(EvalSums)]
    tot = EvalSums(**dict(zip(fields, maker.runtime.all_reduce_sum([getattr(s, f) for f in fields]))))
    out = eval_metrics(tot, cfg, accuracy=maker.rewards.cfg.judges_correctness)
    if cfg.greedy:
        out.update(readable_rewards(maker, greedy_scores))
    if maker.multi_turn:
        out.update(env_metrics(maker, greedy if greedy is not None else sampled))
    return out


def eval_metrics(tot: EvalSums, cfg: EvalConfig, *, accuracy: bool) -> dict[str, float]:
    """``eval/*`` from the sums over all ranks, per prompt; ``accuracy``: whether the rewards judge
    correctness (module docstring), else no ``greedy_accuracy`` and ``pass@k``."""
    n = max(tot.prompts, 1.0)
    out = {"eval/prompts_count": tot.prompts}
    if cfg.greedy:
        out.update({"eval/greedy_reward": tot.greedy_reward / n, "eval/greedy_length": tot.greedy_length / n})
        if accuracy:
            out["eval/greedy_accuracy"] = tot.greedy_correct / n
    if cfg.n_samples > 0:
        out[f"eval/mean@{cfg.n_samples}"] = tot.sampled_reward / n
        if accuracy:
            out[f"eval/pass@{cfg.n_samples}"] = tot.pass_at_k / n
    return out


def readable_rewards(maker: ExperienceMaker, scores: Scores | None) -> dict[str, float]:
    """Over all ranks' greedy rewards (``scores``: this rank's, None without prompts): the lowest and
    highest (``eval/greedy_reward_min`` / ``_max``) and, for each component that reads answers, the
    fraction of responses it could not read (``eval/reward/<name>/unparsed_frac``, what
    :class:`~tidal.rewards.alarms.RewardAlarms` warns about at the start of a run); all are logged."""
    rt = maker.runtime
    total = scores.total_N[scores.valid_N] if scores is not None else None
    high, neg_low = rt.all_reduce_max([float(total.max()) if total is not None and total.numel() else -math.inf,
                                       -float(total.min()) if total is not None and total.numel() else -math.inf])
    out = {"eval/greedy_reward_min": -neg_low, "eval/greedy_reward_max": high}
    names = [n for n, c in maker.rewards.components.items() if isinstance(c, SyncComponent) and c.reads_answers]
    local = scores.metrics if scores is not None else {}
    parts = []
    for name in names:
        count = local.get(f"reward/{name}/unparsed_frac/count", 0.0)
        parts += [local[f"reward/{name}/unparsed_frac"] * count if count else 0.0, count]
    sums = rt.all_reduce_sum(parts) if parts else []
    for k, name in enumerate(names):
        unparsed, count = sums[2 * k], sums[2 * k + 1]
        out[f"eval/reward/{name}/unparsed_frac"] = unparsed / count if count else math.nan
    return out


def env_metrics(maker: ExperienceMaker, result: RolloutResult) -> dict[str, float]:
    """``eval/env/<name>``: the rollout's per-trajectory environment metrics, averaged over the
    trajectories of all ranks (a rank without trajectories weighs nothing; the key set is the union
    over ranks)."""
    count = float(len(result.trajectories))
    local = {k: v for k, v in result.metrics.items() if k not in _NOT_PER_TRAJECTORY}
    keys = sorted(set().union(*maker.runtime.all_gather_objects(sorted(local))))
    sums = maker.runtime.all_reduce_sum([count] + [local.get(k, 0.0) * count for k in keys])
    total = max(sums[0], 1.0)
    return {f"eval/{k}": v / total for k, v in zip(keys, sums[1:])}


def shard_items(items: list[PromptItem], rank: int, world_size: int) -> list[PromptItem]:
    """Rank ``r`` evaluates items r, r+W, r+2W, ... (every item exactly once over all ranks)."""
    return items[rank::world_size]


@dataclasses.dataclass(kw_only=True)
class CheckpointPolicy:
    """The actor of one checkpoint, loaded read-only for ``tidal eval`` / ``tidal export``
    (:func:`tidal.build.build_checkpoint_policy`): ``path`` and ``step`` say which; ``maker`` and
    ``eval_items`` are there for evaluation only (None and [] for an export); ``eval_seed`` is
    this rank's sampling seed, the one the training run's evaluation at ``step`` used."""

    cfg: TrainerSections
    rt: Runtime
    colocation: Colocation
    models: Models
    path: Path
    step: int
    eval_seed: int
    maker: ExperienceMaker | None = None
    eval_items: list[PromptItem] = dataclasses.field(default_factory=list)

    def evaluate(self) -> dict[str, float]:
        """The eval metrics of the checkpoint's actor over all ranks (a collective)."""
        items = shard_items(self.eval_items, self.rt.rank, self.rt.world_size)
        return evaluate(self.maker, items, self.cfg.eval, max_new_tokens=self.cfg.rollout.max_new_tokens, seed=self.eval_seed)
