"""The one owner of the CUDA allocator's peak counter: the peak of allocated (and reserved) device
memory per timer phase and per scope, read by the trainer's memory metrics and by the benchmarks.

The allocator has a single peak counter (``torch.cuda.max_memory_allocated``), reset only by
``torch.cuda.reset_peak_memory_stats``. Two readers that each reset it would each see a peak the
other cut short, so nothing else resets it: :class:`DevicePeaks` watches the run's
:class:`~tidal.logging.timer.PhaseTimer` (it is registered as the timer's first observer, so other
observers read a phase's peak in their own ``phase_end``) and, at every boundary (a phase or
scope begins or ends), folds the counter's value into every phase and scope open then, the step's
peak, and resets it. A phase's peak is therefore the largest allocation seen while it was open,
whatever else opened or closed inside it. Off CUDA nothing is measured (every peak reads None).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch

from tidal.logging.timer import PhaseObserver


@dataclasses.dataclass
class Peak:
    """One open (or ended) phase or scope: bytes allocated when it began, and the largest allocated
    and reserved while it was open."""

    name: str
    start: int = 0
    allocated: int = 0
    reserved: int = 0

    @property
    def above_start(self) -> int:
        """The peak above what was allocated when it began (what it added: activations, temporaries)."""
        return max(0, self.allocated - self.start)


class DevicePeaks(PhaseObserver):
    """Per-phase peaks of ``device``'s allocator (see the module docstring). ``phases`` holds, by
    phase name, the largest peak of any of its instances since the last :meth:`pop`; ``last`` the
    most recent instance of each name that ended."""

    def __init__(self, device: torch.device):
        self.device = device
        self._open: list[Peak] = []
        self.phases: dict[str, Peak] = {}
        self.last: dict[str, Peak] = {}
        self._step = Peak("step")

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def _fold(self) -> None:
        """The counter's peak since the last boundary into every open phase and the step; reset."""
        if not self.cuda:
            return
        alloc = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        for p in (*self._open, self._step):
            p.allocated, p.reserved = max(p.allocated, alloc), max(p.reserved, reserved)
        torch.cuda.reset_peak_memory_stats(self.device)

    def _begin(self, name: str) -> Peak:
        self._fold()
        now = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        peak = Peak(name, start=now, allocated=now, reserved=torch.cuda.memory_reserved(self.device) if self.cuda else 0)
        self._open.append(peak)
        return peak

    def _end(self, peak: Peak) -> None:
        self._fold()
        self._open.remove(peak)
        self.last[peak.name] = peak
        seen = self.phases.get(peak.name)
        if seen is None or peak.allocated > seen.allocated:
            self.phases[peak.name] = peak

    # ---- PhaseObserver ----------------------------------------------------------------------------------
    def phase_begin(self, name: str) -> None:
        self._begin(name)

    def phase_end(self, name: str, seconds: float) -> None:
        for peak in reversed(self._open):  # the innermost open phase of that name
            if peak.name == name:
                self._end(peak)
                return

    # ---- readers ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[Peak]:
        """An untimed window (e.g. one model's update inside the ``train`` phase): the yielded
        :class:`Peak` holds its peak once the block ends (also on error)."""
        peak = self._begin(name)
        try:
            yield peak
        finally:
            self._end(peak)

    def pop(self) -> tuple[dict[str, Peak], Peak | None]:
        """(each phase's largest peak, the step's peak: the largest since the last pop, in or out of
        phases, the first one since the process started; None off CUDA), and a new step begins
        (open phases keep counting)."""
        self._fold()
        phases, step = self.phases, self._step
        self.phases = {}
        self._step = Peak("step")
        return phases, step if self.cuda else None
