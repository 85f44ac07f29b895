"""Experience: one rollout batch as batched tensors, held on the host (CPU) between the rollout and
the update; each micro-batch is moved to the device when it is used (the spec's CPU-offloaded
replay buffer is this: the trainer keeps one rollout's Experience, never a history of them).

Layout (B sequences, T positions, right-padded): ``sequences_BT`` = prompt tokens, response tokens,
padding. Every per-token tensor is aligned with ``sequences_BT``: ``x_BT[b, t]`` belongs to the
token ``sequences_BT[b, t]`` (a logprob is log p(token t | tokens < t)). ``action_mask_BT`` is 1
exactly on response tokens, so prompt and padding never enter a loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# group id = step * STEP_GROUPS + attempt * ATTEMPT_GROUPS + rank * groups_per_rank + k (see first_group_id)
STEP_GROUPS = 1_000_000
ATTEMPT_GROUPS = 10_000


def first_group_id(step: int, rank: int, groups_per_rank: int, attempt: int = 0) -> int:
    """The group id of a rank's first group (prompt) in one rollout; its k-th group is this + k.
    Unique over steps, ranks and sampling attempts (``algorithm.sampling_rounds``) while every
    attempt's groups over all ranks number fewer than ``ATTEMPT_GROUPS`` (with ``attempt`` 0 only,
    e.g. partial rollout's groups in flight: fewer than ``STEP_GROUPS``)."""
    return step * STEP_GROUPS + attempt * ATTEMPT_GROUPS + rank * groups_per_rank


# Experience.row's per-token lists: name in the record -> field.
ROW_TOKEN_FIELDS = {
    "input_ids": "sequences_BT", "action_mask": "action_mask_BT", "rollout_logprobs": "rollout_logp_BT",
    "old_logprobs": "old_logp_BT", "ref_logprobs": "ref_logp_BT", "values": "values_BT", "advantages": "advantages_BT",
    "returns": "returns_BT", "turn_rewards": "turn_rewards_BT",
}


@dataclasses.dataclass(kw_only=True)
class Experience:
    """A batch of B sequences.

    sequences_BT: token ids. attention_mask_BT: 1 on real tokens. action_mask_BT: 1 on response tokens.
    old_logp_BT: the actor's logprobs before this update (the PPO ratio's denominator); None when
        the update's own forward supplies them (one optimizer step per rollout, see
        ``TrainConfig.old_logprobs``).
    rollout_logp_BT: the engine's sampling logprobs (rollout/training mismatch).
    ref_logp_BT: reference-model logprobs (KL on), else None.
    values_BT: critic values (estimators with a critic), else None.
    advantages_BT / returns_BT: from the advantage estimator.
    rewards_B: scalar rewards (after shaping). group_ids_B: the prompt's group id (:func:`first_group_id`),
        shared by a group's samples.
    loss_mask_B: 1 for sequences that enter the loss (0: e.g. dropped reward, masked truncation).
    mm_inputs: per-sequence pixel inputs of the prompt's images (a dict, see :mod:`tidal.models.vision`;
        None for a text row), kept on CPU and collated per micro-batch; None when no row has images.
    routed_experts_BTLK: MoE models on the native engine: int16 ``[B, T, L, K]``, the ``K`` experts the
        engine routed token ``sequences_BT[b, t]`` to in each of the ``L`` MoE layers (-1 where it
        routed none: a row's last token, padding); routing replay and ``moe/router_agreement`` read
        it (:mod:`tidal.models.moe`). None otherwise.
    turn_rewards_BT: a multi-turn rollout's per-turn rewards (the environment's ``StepResult.reward``
        of each turn but the last, whose reward is the outcome in ``rewards_B``), at the last sampled
        token of its turn, 0 elsewhere: the token rewards the advantages added
        (:class:`~tidal.envs.packing.PackedRows`). None for a single-turn rollout.
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT: torch.Tensor
    old_logp_BT: torch.Tensor | None
    rollout_logp_BT: torch.Tensor
    advantages_BT: torch.Tensor
    returns_BT: torch.Tensor
    rewards_B: torch.Tensor
    group_ids_B: torch.Tensor
    loss_mask_B: torch.Tensor
    ref_logp_BT: torch.Tensor | None = None
    values_BT: torch.Tensor | None = None
    mm_inputs: list[dict | None] | None = None
    routed_experts_BTLK: torch.Tensor | None = None
    turn_rewards_BT: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.sequences_BT.shape[0]

    def _tensor_fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def to(self, device: torch.device) -> "Experience":
        out = dataclasses.replace(self)
        for name in self._tensor_fields():
            setattr(out, name, getattr(self, name).to(device, non_blocking=True))
        return out

    def select(self, idx: torch.Tensor | list[int]) -> "Experience":
        """Rows ``idx``, trimmed to the longest remaining sequence (less padding per micro-batch)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        rows = idx_t.tolist()
        out = dataclasses.replace(self, mm_inputs=[self.mm_inputs[i] for i in rows] if self.mm_inputs is not None else None)
        T = int(self.attention_mask_BT[idx_t].sum(-1).max()) if len(idx_t) else 0
        for name in self._tensor_fields():
            t = getattr(self, name)[idx_t]
            setattr(out, name, t[:, :T] if t.dim() >= 2 else t)
        return out

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as the update trains on it, as lists over its real tokens (``attention_mask_BT``):
        ``input_ids``; ``action_mask`` (1: a sampled token, in the loss when ``loss_mask`` is 1);
        per token, the value for the token at that position (0 off the action mask):
        ``rollout_logprobs`` (the engine's), ``old_logprobs`` (the trainer's before the update),
        ``ref_logprobs``, ``values``, ``advantages``, ``returns``, ``turn_rewards`` (multi-turn: each
        turn's reward at its last sampled token); and the row's ``reward``,
        ``loss_mask`` and ``group_id``. A tensor the run does not compute is left out (``old_logprobs``
        when the update's forward supplies them, see ``old_logp_BT``)."""
        keep = self.attention_mask_BT[i].bool()
        out: dict[str, Any] = {}
        for name, field in ROW_TOKEN_FIELDS.items():
            t = getattr(self, field)
            if t is not None:
                out[name] = t[i][keep].tolist()
        out.update(reward=float(self.rewards_B[i]), loss_mask=float(self.loss_mask_B[i]), group_id=int(self.group_ids_B[i]))
        return out

    @property
    def response_len_B(self) -> torch.Tensor:
        return self.action_mask_BT.sum(-1)


def concat_experiences(items: list[Experience]) -> Experience:
    """Concatenate along B, right-padding all [B, T] tensors to the longest T."""
    T = max(e.sequences_BT.shape[1] for e in items)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Experience):
        vals = [getattr(e, f.name) for e in items]
        if f.name == "mm_inputs":
            out[f.name] = None if all(v is None for v in vals) else [m for e, v in zip(items, vals) for m in (v or [None] * len(e))]
        elif vals[0] is None:
            out[f.name] = None
        elif vals[0].dim() == 2:
            out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1])) for v in vals])
        else:
            out[f.name] = torch.cat(vals)
    return Experience(**out)


def token_budget_batches(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Split indices into micro-batches whose padded size (rows x longest row) stays within
    ``max_tokens`` and ``max_seqs`` rows, taking sequences in order of length. Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if cur and ((len(cur) + 1) * new_longest > max_tokens or len(cur) >= max_seqs):
            batches.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    return batches


def packed_micro_batches(lengths: list[int], max_tokens: int, max_seqs: int, *, setting: str = "train.micro_batch_tokens") -> list[list[int]]:
    """Split indices into micro-batches for packed forwards (:mod:`tidal.models.packing`): each holds
    at most ``max_tokens`` real tokens (the sum of its sequences' lengths; no padding counts) and
    ``max_seqs`` sequences. First-fit decreasing: sequences in order of decreasing length (ties by
    index) each go into the first micro-batch with room, so all but the last few micro-batches are
    nearly full. Deterministic; each micro-batch lists its indices in increasing order; micro-batches
    come in order of creation (the longest sequences first).

    A sequence longer than ``max_tokens`` cannot be packed (it is never split: its tokens attend to
    each other): a ValueError names ``setting``, the budget's config key."""
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i = max(too_long, key=lambda j: lengths[j])
        raise ValueError(
            f"sequence {i} has {lengths[i]} tokens, more than {setting}={max_tokens} ({len(too_long)} sequences are too long); "
            f"raise {setting} to at least {lengths[i]} or shorten prompts/responses (data.max_prompt_len, rollout.max_new_tokens)"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free and len(bins[b]) < max_seqs:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]
