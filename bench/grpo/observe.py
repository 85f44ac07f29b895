"""The benchmark's view of a Tidal trainer, through its public observer hook only
(``trainer.timer.add_observer``)."""

from __future__ import annotations

import time

import torch

from tidal.logging import PhaseObserver


class TidalObserver(PhaseObserver):
    """Records (label, allocated, reserved, device used) at every phase boundary of Tidal's
    PhaseTimer, with the phase's own peak (read from the run's
    :class:`~tidal.logging.memory_peaks.DevicePeaks`, ``trainer.colocation.peaks``, the one owner of the
    allocator's peak counter: nothing here resets it), and around every
    placement move of the phase owner (``<action>/<role>:before`` / ``:after`` events, with the bytes
    the move returned; ``calls`` times each move); ``rollouts`` keeps each ``generate:done`` (prompts,
    completion lengths, finish reasons). Without CUDA the labels are recorded with None bytes."""

    def __init__(self, peaks):
        self.peaks = peaks
        self.cuda = peaks.cuda
        self.points: list[dict] = []
        self.calls: list[dict] = []
        self.rollouts: list[dict] = []
        self._started: dict[str, float] = {}

    def _mem(self):
        if not self.cuda:
            return None, None, None
        free, total = torch.cuda.mem_get_info()
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), total - free

    def mark(self, label: str, **extra) -> None:
        a, r, used = self._mem()
        self.points.append({"label": label, "allocated": a, "reserved": r, "device_used": used, **extra})

    def peaks_so_far(self) -> tuple[int | None, int | None]:
        """(allocated, reserved) peaks since the process started or the last call (at setup: the
        model loads), and a new step of the peak owner begins."""
        _, step = self.peaks.pop()
        return (step.allocated, step.reserved) if step is not None else (None, None)

    def phase_begin(self, name):
        self.mark(f"{name}:start")

    def phase_end(self, name, seconds):
        # the peak owner is the timer's first observer: the phase that just ended is folded already
        p = self.peaks.last.get(name) if self.cuda else None
        self.mark(f"{name}:end", peak=p.allocated if p else None, peak_reserved=p.reserved if p else None)

    def event(self, name, info=None):
        if name == "generate:done":
            self.rollouts.append({"prompts": info["prompts"], "lengths": list(info["completion_lengths"]),
                                  "finish_reasons": list(info.get("finish_reasons") or [])})
            return
        what, _, when = name.rpartition(":")
        returned = (info or {}).get("bytes")
        self.mark(name, **({"returned": returned} if when == "after" else {}))
        if when == "before":
            self._started[what] = time.perf_counter()
        elif when == "after" and what in self._started:
            self.calls.append({"name": what, "seconds": time.perf_counter() - self._started.pop(what), "returned": returned})

    def pop(self) -> tuple[list[dict], list[dict]]:
        """The points and calls since the last pop."""
        points, calls = self.points, self.calls
        self.points, self.calls = [], []
        return points, calls
