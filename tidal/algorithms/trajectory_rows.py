"""Trajectories split over several rows: lay their rows end to end for the advantage estimators.

A multi-turn trajectory is normally one row (prompt, turn 1, observation 1, turn 2, ...). When the
chat template rewrites earlier turns (e.g. Qwen3 drops the ``<think>`` blocks of earlier turns),
each turn becomes its own row whose prompt is the re-rendered history (see docs/agentic.md). The
estimators must still see ONE sample per trajectory: group statistics count it once, and returns
and GAE flow from a later turn into the earlier ones. :func:`merge_rows` concatenates the rows of
each trajectory along T (row k of a trajectory occupies positions ``[k*T, (k+1)*T)`` of its merged
row; the prompts and padding between them are off the mask, i.e. gaps the estimators skip), and
:func:`split_rows` scatters a merged result back to the original rows.
"""

from __future__ import annotations

import dataclasses

from tidal.algorithms.base import AdvantageInput
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each original row went: ``flat_index_BT[b, t]`` is the index of ``x[b, t]`` in the
    flattened merged tensor ``[N, K*T]`` (N trajectories, K the most rows of one trajectory)."""

    flat_index_BT: torch.Tensor
    num_trajectories: int
    merged_len: int


def _layout(trajectory_ids_B: torch.Tensor, T: int) -> tuple[RowLayout, torch.Tensor, torch.Tensor]:
    """(layout, trajectory index per row, first row of each trajectory)."""
    ids = trajectory_ids_B.tolist()
    order: dict[int, int] = {}
    slot_B, traj_B = [], []
    counts: list[int] = []
    for tid in ids:
        j = order.setdefault(tid, len(order))
        if j == len(counts):
            counts.append(0)
        slot_B.append(counts[j])
        traj_B.append(j)
        counts[j] += 1
    K = max(counts) if counts else 1
    traj = torch.tensor(traj_B, dtype=torch.long)
    slot = torch.tensor(slot_B, dtype=torch.long)
    base_B = (traj * K + slot) * T
    flat_index_BT = base_B[:, None] + torch.arange(T)[None, :]
    first_rows = torch.tensor([ids.index(t) for t in order], dtype=torch.long)
    return RowLayout(flat_index_BT=flat_index_BT, num_trajectories=len(order), merged_len=K * T), traj, first_rows


def _merge(x_BT: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    flat = torch.zeros(layout.num_trajectories * layout.merged_len, dtype=x_BT.dtype, device=x_BT.device)
    flat[layout.flat_index_BT.to(x_BT.device).reshape(-1)] = x_BT.reshape(-1)
    return flat.view(layout.num_trajectories, layout.merged_len)


def split_rows(x_NT: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """The merged ``[N, K*T]`` tensor back in the original ``[B, T]`` rows."""
    return x_NT.reshape(-1)[layout.flat_index_BT.to(x_NT.device)]


def merge_rows(inp: AdvantageInput) -> tuple[AdvantageInput, RowLayout]:
    """One merged row per trajectory (``inp.trajectory_ids_B`` must be set). Raises ValueError when
    the rows of one trajectory disagree on their group id or their reward."""
    assert inp.trajectory_ids_B is not None
    T = inp.action_mask_BT.shape[1]
    layout, traj_B, first = _layout(inp.trajectory_ids_B.cpu(), T)
    dev = inp.rewards_B.device
    traj_B = traj_B.to(dev)
    first = first.to(dev)
    for name, x_B in (("group_ids_B", inp.group_ids_B), ("rewards_B", inp.rewards_B)):
        if not torch.equal(x_B, x_B[first][traj_B]):
            bad = int((x_B != x_B[first][traj_B]).nonzero()[0, 0])
            raise ValueError(
                f"AdvantageInput.{name}: row {bad} differs from the first row of its trajectory "
                f"(trajectory id {int(inp.trajectory_ids_B[bad])}); the rows of one trajectory share it"
            )
    merged = AdvantageInput(
        rewards_B=inp.rewards_B[first],
        action_mask_BT=_merge(inp.action_mask_BT, layout),
        group_ids_B=inp.group_ids_B[first],
        token_rewards_BT=None if inp.token_rewards_BT is None else _merge(inp.token_rewards_BT, layout),
        values_BT=None if inp.values_BT is None else _merge(inp.values_BT, layout),
    )
    return merged, layout
