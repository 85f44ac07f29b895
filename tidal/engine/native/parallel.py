"""The rollout tensor-parallel group as the engine sees it: rank, size and the few collectives it uses.

The engine never creates a process group: it is handed one (or ``None`` for TP=1) by the caller.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """A view of the rollout TP group. ``group=None`` means a single rank (every collective is a no-op)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> "TPGroup":
        if group is None:
            return cls(group=None, rank=0, size=1)
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (and return it)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the group (a tensor on ``device``, the group's backend's)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on TP rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` on every rank with TP rank 0's ``x`` (in place)."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x
