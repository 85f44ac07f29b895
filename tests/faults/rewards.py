"""Reward functions for fault tests: a deterministic varied one, and ones that misbehave on cue."""

import math
import zlib

CALLS = {"n": 0}


def text_hash_reward(sample) -> float:
    """A number in [0, 1) from the response text alone: every group has signal, runs are reproducible."""
    return (zlib.crc32(sample.response.encode()) % 1000) / 1000.0


def nan_from_third_step(sample) -> float:
    """NaN for every sample from the third call with sample index 0 on (a world of one, 4 prompts x 4
    samples a step: the third training step) -- a reward model that starts emitting NaN mid-run."""
    if sample.index == 0:
        CALLS["n"] += 1
    return math.nan if CALLS["n"] >= 3 else text_hash_reward(sample)


def nan_on_odd_index(sample) -> float:
    """NaN for odd sample indices: half the samples of every step are broken."""
    return math.nan if sample.index % 2 else text_hash_reward(sample)


def wrong_length_batched(samples) -> list[float]:
    """A batched function that drops the last score."""
    return [text_hash_reward(s) for s in samples[:-1]]


wrong_length_batched.batched = True
