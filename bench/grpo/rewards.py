"""The reward both frameworks score with: a deterministic hash of the completion's token ids, so
reward time is not what gets measured and rewards vary within a group."""

from __future__ import annotations


def bench_score(completion_ids) -> float:
    """A score in [0, 1) of a completion's token ids."""
    return (sum(int(t) for t in completion_ids) % 997) / 997.0


def tidal_reward(samples) -> list[float]:
    """Tidal batched reward function (``bench.grpo.rewards:tidal_reward``)."""
    return [bench_score(s.response_ids) for s in samples]


tidal_reward.batched = True


def trl_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """TRL reward function: the same score from the completion token ids."""
    return [bench_score(ids) for ids in completion_ids]
