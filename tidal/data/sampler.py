"""A stateful distributed sampler: which prompt indices each rank takes at each rollout step.

Contract. Epoch ``e`` orders the ``num_items`` indices by ``torch.randperm(num_items)`` drawn from a
CPU generator seeded with ``seed + e`` (or ``0..num_items-1`` when ``shuffle`` is false). Step ``k``
of the epoch takes the global batch ``order[k*G : (k+1)*G]`` with ``G = world_size *
batch_size_per_rank``; rank ``r`` gets the contiguous slice ``[r*b : (r+1)*b]`` of it. So within an
epoch no index is given twice, across steps or ranks. With ``drop_last`` the ``num_items mod G``
leftover indices of the epoch are not used; without it the last step is completed with indices
from the start of that epoch's order (those few repeat). After the epoch's last step the next
call starts epoch ``e + 1``.

The state is the position ``(epoch, step)`` of the *next* batch; ``load_state_dict`` of a saved
state makes the sampler yield exactly the batches the original would have yielded next. The
position is stored in global items, so a run may resume on another world size with the same
global batch.
"""

from __future__ import annotations

from typing import Any

import torch


class StatefulDistributedSampler:
    """Per-rank prompt indices for one rollout step at a time; see the module docstring."""

    def __init__(
        self,
        num_items: int,
        *,
        rank: int,
        world_size: int,
        batch_size_per_rank: int,
        seed: int,
        shuffle: bool,
        drop_last: bool = True,
        data_hash: str = "",
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if batch_size_per_rank < 1:
            raise ValueError(f"batch_size_per_rank must be >= 1, got {batch_size_per_rank}")
        self.num_items = num_items
        self.rank = rank
        self.world_size = world_size
        self.batch_size_per_rank = batch_size_per_rank
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.data_hash = data_hash  # the content of the data it indexes (a dataset's content_hash), checked on resume
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{num_items} prompts cannot fill one global batch of {self.global_batch_size} "
                f"({world_size} ranks x {batch_size_per_rank}) with drop_last; use more data or a smaller batch"
            )
        self.epoch = 0
        self.step_in_epoch = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.batch_size_per_rank

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def next_batch(self) -> list[int]:
        """This rank's ``batch_size_per_rank`` indices for the next step; advances the position."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        order = self._epoch_order()
        start = self.step_in_epoch * self.global_batch_size + self.rank * self.batch_size_per_rank
        positions = torch.arange(start, start + self.batch_size_per_rank) % self.num_items
        self.step_in_epoch += 1
        return order[positions].tolist()

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                gen = torch.Generator(device="cpu").manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_items, generator=gen)
            else:
                self._order = torch.arange(self.num_items)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch plus what must match on load."""
        return {
            "epoch": self.epoch,
            "items_consumed": self.step_in_epoch * self.global_batch_size,
            "num_items": self.num_items,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "data_hash": self.data_hash,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`; raises ValueError if the data (its size, or
        its content by ``data_hash`` when both sides have one) or batching differ."""
        for key in ("num_items", "global_batch_size", "seed", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this run has {getattr(self, key)!r}; cannot resume exactly")
        saved = state.get("data_hash", "")  # none in checkpoints saved before it was recorded
        if saved and self.data_hash and saved != self.data_hash:
            raise ValueError(f"the data's content hash was {saved} and is {self.data_hash} now, with the same {self.num_items} "
                             "items: rows were changed or reordered; cannot resume exactly")
        step, rest = divmod(int(state["items_consumed"]), self.global_batch_size)
        if rest or not 0 <= step <= self.steps_per_epoch:
            raise ValueError(f"sampler state position {state['items_consumed']} is not a step boundary of this run")
        self.epoch = int(state["epoch"])
        self.step_in_epoch = step
