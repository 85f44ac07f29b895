"""Rewards for pipeline tests: deterministic, but varied within a group so every estimator has signal."""

import zlib


def text_hash_reward(sample) -> float:
    """A number in [0, 1) from the response text alone (the same text always scores the same)."""
    return (zlib.crc32(sample.response.encode()) % 1000) / 1000.0


def constant_reward(sample) -> float:
    """The same reward for every response: group-normalised advantages are all zero."""
    return 0.5


def assistant_turns_reward(sample) -> float:
    """The number of assistant turns in the whole conversation (reward functions receive it)."""
    return float(sum(m["role"] == "assistant" for m in sample.messages))
