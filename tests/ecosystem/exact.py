"""Token ownership, checked the same way for every adapter: what the trainer trains on is what the
engine sampled. ``Recorder`` wraps an engine's ``generate`` and keeps every completion it returned;
:func:`assert_trained_equals_sampled` packs a rollout's trajectories as the trainer does and checks,
for every run of sampled tokens (action mask 1) of every row, that the engine was given exactly the
tokens before it as its prompt and sampled exactly those ids with exactly those logprobs, and that
every completion the engine returned is trained on exactly once."""

from __future__ import annotations

from collections import Counter

import torch

from tidal.envs import pack_trajectories


class Recorder:
    def __init__(self, generate):
        self.inner, self.completions = generate, []

    def generate(self, prompts, params, **kwargs):
        out = self.inner(prompts, params, **kwargs)
        self.completions.extend(out)
        return out


def sampled_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def assert_trained_equals_sampled(result, completions, pad_id: int) -> int:
    """The check of the module docstring; returns how many sampled runs (turns) it matched."""
    # the trainer holds logprobs as float32: the engine's, rounded the same way, must be equal bit for bit
    sampled = Counter((tuple(c.prompt_ids), tuple(c.token_ids), tuple(torch.tensor(c.logprobs, dtype=torch.float32).tolist()))
                      for c in completions)
    trained = Counter()
    packed = pack_trajectories(result.trajectories, pad_id=pad_id)
    for b in range(packed.sequences_BT.shape[0]):
        keep = packed.attention_mask_BT[b].bool()
        ids = packed.sequences_BT[b][keep].tolist()
        mask = packed.action_mask_BT[b][keep].tolist()
        logp = packed.rollout_logp_BT[b][keep].tolist()
        for s, e in sampled_runs(mask):
            key = (tuple(ids[:s]), tuple(ids[s:e]), tuple(logp[s:e]))
            assert key in sampled, (f"row {b}: tokens {s}:{e} (with their logprobs) were not sampled by the engine after "
                                    "exactly this context")
            trained[key] += 1
    assert trained == sampled, "a completion is trained on twice, or never"
    return sum(trained.values())


def assert_trainer_logprobs_equal_engine(result, model, pad_id: int, atol: float = 2e-4) -> None:
    """The trainer's log-probabilities of the packed rows equal the engine's sampling logprobs on
    every sampled token (fp32 on the CPU on both sides), as tests/envs/test_envs_logprobs.py does."""
    from tidal.models.logprobs import attach_logprob_method, token_logprobs

    packed = pack_trajectories(result.trajectories, pad_id=pad_id)
    attach_logprob_method(model)
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model, packed.sequences_BT, packed.attention_mask_BT, positions_BT=packed.action_mask_BT)
    mask = packed.action_mask_BT.bool()
    assert mask.any()
    assert (logp_BT[mask] - packed.rollout_logp_BT[mask]).abs().max() < atol
