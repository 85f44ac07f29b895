"""Trajectories -> the [B, T] tensors of an Experience (one row per trajectory row).

The layout is the trainer's (:mod:`tidal.trainer.experience`): right-padded ``sequences_BT``;
``action_mask_BT`` 1 exactly on the sampled tokens (not contiguous in a multi-turn row);
``rollout_logp_BT`` the engine's sampling logprobs on them. For a single-turn trajectory this is
exactly what the trainer packed from a plain completion before environments existed. In addition:
per-turn rewards as ``token_rewards_BT`` (each at the last sampled token of its turn) and
``trajectory_ids_B``. A trajectory that never got a turn (its ``reset`` failed, ``env.on_error:
drop``) is one row holding its prompt, with an empty action mask and ``valid_B`` False, so every
prompt keeps its n rows and a rank never has an empty batch.
"""

from __future__ import annotations

import dataclasses

import torch

from tidal.envs.trajectory import Trajectory


@dataclasses.dataclass(kw_only=True)
class PackedRows:
    """B rows of N trajectories.

    sequences_BT / attention_mask_BT / action_mask_BT / rollout_logp_BT: as in Experience.
    token_rewards_BT: per-turn rewards at the last sampled token of each turn (0 elsewhere); add
        it to the KL-in-reward token rewards for ``AdvantageInput.token_rewards_BT``.
    trajectory_ids_B: index into ``trajectories`` of each row's trajectory.
    group_ids_B: the prompt group of each row.
    valid_B: False on the rows of trajectories that must leave the loss (``Trajectory.valid``).
    trajectories: the packed trajectories, in order (all of them).
    mm_inputs: each row's prompt images (its trajectory's ``row.mm_inputs``, None for a text row),
        or None when no row has images.
    routed_BTLK: MoE routing replay data (int16 ``[B, T, L, K]``, -1 where the engine did not route
        the token, see :mod:`tidal.models.moe`), or None when no row has any.
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT: torch.Tensor
    rollout_logp_BT: torch.Tensor
    token_rewards_BT: torch.Tensor
    trajectory_ids_B: torch.Tensor
    group_ids_B: torch.Tensor
    valid_B: torch.Tensor
    trajectories: list[Trajectory]
    mm_inputs: list[dict | None] | None = None
    routed_BTLK: torch.Tensor | None = None

    @property
    def multi_row(self) -> bool:
        """True when some trajectory spans several rows (``env.history: template``)."""
        return self.sequences_BT.shape[0] > len(self.trajectories)

    def advantage_trajectory_ids(self) -> torch.Tensor | None:
        """``AdvantageInput.trajectory_ids_B``: the ids when some trajectory spans rows, else None."""
        return self.trajectory_ids_B if self.multi_row else None

    def per_row(self, x_N: torch.Tensor) -> torch.Tensor:
        """A per-trajectory tensor [N] (e.g. rewards) repeated on each of its rows [B]."""
        return x_N[self.trajectory_ids_B]

    def row_list(self, xs: list) -> list:
        """A per-trajectory list repeated on each row, as a list of B."""
        return [xs[i] for i in self.trajectory_ids_B.tolist()]


def _routed(rows: list, T: int) -> torch.Tensor | None:
    """The rows' engine routing as ``[B, T, L, K]`` (-1 where none), or None when no row has any."""
    have = [r.routed_experts for _, r in rows if r.routed_experts is not None]
    if not have:
        return None
    out = torch.full((len(rows), T, *have[0].shape[1:]), -1, dtype=torch.int16)
    for b, (_, r) in enumerate(rows):
        if r.routed_experts is not None:
            out[b, : len(r.routed_experts)] = torch.from_numpy(r.routed_experts)
    return out


def pack_trajectories(trajectories: list[Trajectory], pad_id: int) -> PackedRows:
    rows = [(i, r) for i, t in enumerate(trajectories) for r in t.rows]
    B = len(rows)
    T = max((len(r.input_ids) for _, r in rows), default=0)
    seq = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    act = torch.zeros((B, T), dtype=torch.float32)
    logp = torch.zeros((B, T), dtype=torch.float32)
    turn_r = torch.zeros((B, T), dtype=torch.float32)
    first_row = [0]
    for t in trajectories:
        first_row.append(first_row[-1] + len(t.rows))
    for b, (_, r) in enumerate(rows):
        P, L = len(r.prompt_ids), len(r.token_ids)
        seq[b, : P + L] = torch.tensor(r.input_ids, dtype=torch.long)
        attn[b, : P + L] = 1
        act[b, P : P + L] = torch.tensor(r.action_mask, dtype=torch.float32)
        logp[b, P : P + L] = torch.tensor(r.logprobs, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        for turn in t.turns:
            if turn.reward:
                b = first_row[i] + turn.row
                turn_r[b, len(t.rows[turn.row].prompt_ids) + turn.start + turn.num_sampled - 1] += turn.reward
    mm = [trajectories[i].row.mm_inputs for i, _ in rows]
    return PackedRows(
        routed_BTLK=_routed(rows, T),
        sequences_BT=seq, attention_mask_BT=attn, action_mask_BT=act, rollout_logp_BT=logp, token_rewards_BT=turn_r,
        trajectory_ids_B=torch.tensor([i for i, _ in rows], dtype=torch.long),
        group_ids_B=torch.tensor([trajectories[i].group_id for i, _ in rows], dtype=torch.long),
        valid_B=torch.tensor([trajectories[i].valid and bool(trajectories[i].turns) for i, _ in rows], dtype=torch.bool),
        trajectories=list(trajectories),
        mm_inputs=mm if any(m is not None for m in mm) else None,
    )
