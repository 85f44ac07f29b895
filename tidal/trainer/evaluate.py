"""Evaluation on held-out prompts: greedy accuracy and sampled pass@k / mean@k over ALL ranks.

Uses the same generation and reward chain as training but builds no Experience for training,
updates no parameters, and leaves training statistics (reward normalisers, the sampler, RNG
streams of training) untouched: sampling here uses its own seeded generator.
"""

from __future__ import annotations

import dataclasses

from tidal.data import PromptItem
from tidal.engine.base import SamplingParams
from tidal.trainer.config import EvalConfig
from tidal.trainer.experience_maker import ExperienceMaker, Rollout


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
    with maker.phases.rollout() as engine:
        if cfg.greedy:
            greedy = maker.completions(engine, items, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, n=1))
        if cfg.n_samples > 0:
            params = SamplingParams(temperature=cfg.temperature, max_new_tokens=max_new_tokens, n=cfg.n_samples, seed=seed)
            sampled = maker.completions(engine, items, params)
    if greedy is not None and items:
        _, rew = maker.score(_rollout(items, greedy))
        s.greedy_reward = float(rew.total_B.sum())
        s.greedy_correct = float((rew.total_B >= cfg.correct_threshold).sum())
        s.greedy_length = float(sum(len(c.token_ids) for c in greedy))
    if sampled is not None:
        if items:
            _, rew = maker.score(_rollout(items, sampled))
            total_PK = rew.total_B.view(len(items), cfg.n_samples)
            s.sampled_reward = float(total_PK.mean(-1).sum())
            s.pass_at_k = float((total_PK >= cfg.correct_threshold).any(-1).float().sum())
    fields = [f.name for f in dataclasses.fields(EvalSums)]
    tot = dict(zip(fields, maker.runtime.all_reduce_sum([getattr(s, f) for f in fields])))
    n = max(tot["prompts"], 1.0)
    out = {"eval/prompts": tot["prompts"]}
    if cfg.greedy:
        out.update({
            "eval/greedy_accuracy": tot["greedy_correct"] / n,
            "eval/greedy_reward": tot["greedy_reward"] / n,
            "eval/greedy_length": tot["greedy_length"] / n,
        })
    if cfg.n_samples > 0:
        out.update({f"eval/mean@{cfg.n_samples}": tot["sampled_reward"] / n, f"eval/pass@{cfg.n_samples}": tot["pass_at_k"] / n})
    return out


def _rollout(items, comps):
    n = len(comps) // len(items)
    return Rollout(items=items, completions=comps, group_ids=[i for i in range(len(items)) for _ in range(n)])


def shard_items(items: list[PromptItem], rank: int, world_size: int) -> list[PromptItem]:
    """Rank ``r`` evaluates items r, r+W, r+2W, ... (every item exactly once over all ranks)."""
    return items[rank::world_size]

