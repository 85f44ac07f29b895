"""Wall-clock timers per training phase (generate, reward, update, sync, ...), and the observer hook
that lets tools (the benchmark's memory timeline and profiler ranges) watch phases without patching."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from tidal.lazy import lazy_module

torch = lazy_module("torch")


def _sync_cuda() -> None:
    # Kernels are asynchronous: without a sync the clock would stop before the phase's GPU work ends.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseObserver:
    """Watches a :class:`PhaseTimer` (register with :meth:`PhaseTimer.add_observer`). Every method is
    a no-op here; override what you need. Calls come on the training thread, after the device is
    synchronised at phase boundaries (so device memory and time read there belong to the phase).

    phase_begin(name) / phase_end(name, seconds): a timed phase starts / ends (phases may nest).
    event(name, info): an instantaneous mark inside a phase, e.g. ``wake_up/engine:before`` and
        ``wake_up/engine:after`` around each placement move the phase owner makes
        (:class:`tidal.trainer.colocation.Colocation`: ``<action>/<role>``), with ``info`` (e.g.
        bytes moved) on the ``:after`` mark; ``generate:done`` after each generation, with ``info``
        ``{"prompts": n, "completion_lengths": [...], "finish_reasons": [...]}`` (this rank's
        sequences, prompt-major; a reason is ``stop`` or ``length``).
    """

    def phase_begin(self, name: str) -> None:
        pass

    def phase_end(self, name: str, seconds: float) -> None:
        pass

    def event(self, name: str, info: dict | None = None) -> None:
        pass


class PhaseTimer:
    """Accumulates wall seconds per phase name until :meth:`pop`.

    ``with timer.phase("generate"):`` adds the block's duration to ``generate`` (a phase may be
    entered several times per step; nested phases each count their own full duration). CUDA is
    synchronized before each clock read when it is in use, so GPU work is charged to the phase
    that launched it. ``pop()`` returns ``{"time/<phase>": seconds}`` and starts afresh. Observers
    (:class:`PhaseObserver`) see every phase boundary and :meth:`event`.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] = _sync_cuda):
        self._clock = clock
        self._sync = sync
        self._totals: dict[str, float] = {}
        self._observers: list[PhaseObserver] = []

    def add_observer(self, observer: PhaseObserver) -> None:
        self._observers.append(observer)

    def remove_observer(self, observer: PhaseObserver) -> None:
        self._observers.remove(observer)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        for obs in self._observers:
            obs.phase_begin(name)
        start = self._clock()
        try:
            yield
        finally:
            self._sync()
            seconds = self._clock() - start
            self._totals[name] = self._totals.get(name, 0.0) + seconds
            for obs in self._observers:
                obs.phase_end(name, seconds)

    def event(self, name: str, info: dict | None = None) -> None:
        """Tell the observers about ``name`` (no timing; a no-op without observers)."""
        if not self._observers:
            return
        self._sync()
        for obs in self._observers:
            obs.event(name, info)

    def pop(self) -> dict[str, float]:
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        self._totals = {}
        return out
