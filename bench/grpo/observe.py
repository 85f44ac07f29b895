"""The benchmark's view of a Tidal trainer, through its public observer hook only
(``trainer.timer.add_observer``)."""

from __future__ import annotations

import time

import torch

from tidal.logging import PhaseObserver


class TidalObserver(PhaseObserver):
    """Records (label, allocated, reserved, device used) at every phase boundary of Tidal's
    PhaseTimer, with the phase's own peak (peak stats are reset at its start), and around every
    placement move of the phase owner (``<action>/<role>:before`` / ``:after`` events, with the bytes
    the move returned; ``calls`` times each move); ``rollouts`` keeps each ``generate:done`` (prompts,
    completion lengths, finish reasons). Without CUDA the labels are recorded with None bytes."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
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

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def peak_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved() if self.cuda else None

    def phase_begin(self, name):
        self.mark(f"{name}:start")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def phase_end(self, name, seconds):
        self.mark(f"{name}:end", peak=self.peak(), peak_reserved=self.peak_reserved())

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
