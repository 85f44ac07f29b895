"""Wall-clock timers per training phase (generate, reward, update, sync, ...)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch


def _sync_cuda() -> None:
    # Kernels are asynchronous: without a sync the clock would stop before the phase's GPU work ends.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseTimer:
    """Accumulates wall seconds per phase name until :meth:`pop`.

    ``with timer.phase("generate"):`` adds the block's duration to ``generate`` (a phase may be
    entered several times per step; nested phases each count their own full duration). CUDA is
    synchronized before each clock read when it is in use, so GPU work is charged to the phase
    that launched it. ``pop()`` returns ``{"time/<phase>": seconds}`` and starts afresh.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = _sync_cuda):
        self._clock = clock
        self._sync = sync
        self._totals: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        start = self._clock()
        try:
            yield
        finally:
            self._sync()
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - start)

    def pop(self) -> dict[str, float]:
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        self._totals = {}
        return out
