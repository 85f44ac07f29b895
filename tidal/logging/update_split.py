"""Where the update phase's time goes: forward, backward, optimizer step and offload transfers, and the
train phase's model FLOPs utilisation.

:class:`UpdateSplit` times parts the updater marks (``with split.part("forward"): ...``). On CUDA
each part is a pair of CUDA events on the current stream, read once in :meth:`UpdateSplit.pop` (one
synchronisation per iteration, none per micro-batch); on the CPU, the host clock. Transfers need no
marks in the updater: as a :class:`~tidal.logging.timer.PhaseObserver` of the run's timer the split
times the phase owner's placement moves (``reload_optimizer``/``offload_optimizer``,
``reload_model``/``offload_model``) made inside the ``train`` phase, from their ``:before`` and
``:after`` events (the timer synchronises the device at each).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from tidal.logging.timer import PhaseObserver

PARTS = ("forward", "backward", "optimizer", "transfer")
TRANSFERS = ("reload_optimizer", "offload_optimizer", "reload_model", "offload_model")


class UpdateSplit(PhaseObserver):
    """Seconds per part of the update (see the module docstring). ``pop()`` returns
    ``perf/<part>_s`` for ``forward``, ``backward``, ``optimizer`` and ``transfer``."""

    def __init__(self, device: torch.device, *, train_phase: str = "train"):
        self.device = device
        self.train_phase = train_phase
        self._pairs: dict[str, list] = {p: [] for p in PARTS}
        self._host: dict[str, float] = {p: 0.0 for p in PARTS}
        self._in_train = 0
        self._open: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as part ``name`` (one of :data:`PARTS`)."""
        if name not in self._pairs:
            raise ValueError(f"unknown update part {name!r}; one of {PARTS}")
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pairs[name].append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host[name] += time.perf_counter() - t0

    # ---- transfers, from the phase owner's events ---------------------------------------------------------
    def phase_begin(self, name: str) -> None:
        self._in_train += name == self.train_phase

    def phase_end(self, name: str, seconds: float) -> None:
        self._in_train -= name == self.train_phase

    def event(self, name: str, info: dict | None = None) -> None:
        action, _, mark = name.rpartition(":")
        if self._in_train <= 0 or action.split("/")[0] not in TRANSFERS:
            return
        if mark == "before":
            self._open[action] = time.perf_counter()
        elif mark == "after" and action in self._open:
            self._host["transfer"] += time.perf_counter() - self._open.pop(action)

    def pop(self) -> dict[str, float]:
        """Seconds per part since the last pop (reads the CUDA events: one synchronisation)."""
        out = dict(self._host)
        pairs = [(p, s, e) for p, lst in self._pairs.items() for s, e in lst]
        if pairs:
            pairs[-1][2].synchronize()
            torch.cuda.synchronize(self.device)
            for p, s, e in pairs:
                out[p] += s.elapsed_time(e) / 1e3
        self._pairs = {p: [] for p in PARTS}
        self._host = {p: 0.0 for p in PARTS}
        return {f"perf/{p}_s": v for p, v in out.items()}


def train_perf(flops: float, seconds: float, peak_flops_per_s: float | None) -> dict[str, float]:
    """``perf/train_tflops`` (model TFLOP/s of the train phase) and, with a peak, ``perf/mfu``."""
    from tidal.models.flops import mfu

    out = {"perf/train_tflops": flops / seconds / 1e12 if seconds > 0 else 0.0}
    if peak_flops_per_s:
        out["perf/mfu"] = mfu(flops, seconds, peak_flops_per_s)
    return out
