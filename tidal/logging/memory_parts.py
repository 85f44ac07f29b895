"""The step's device memory by component: what one rank's device holds, and for what.

``memory/*`` metrics (rank 0's device, CUDA only; GiB):

- ``device_used_gib``: everything the device holds (``cudaMemGetInfo``: also memory outside
  PyTorch's allocator, an engine's KV cache, other processes); ``reserved_gib``: PyTorch's caching
  allocator; ``peak_allocated_gib``: its peak of allocated tensors over the step.
- ``{actor,critic}_weights_gib`` and ``{actor,critic}_optimizer_gib``: the trained model's
  parameters and optimizer state on the device during its update (local shards, each storage once:
  :meth:`tidal.strategy.base.Strategy.resident_bytes`); ``{actor,critic}_activations_peak_gib``: the
  update's peak of allocated memory above what was allocated at its start (activations, gradients
  and the optimizer step's temporaries; the largest of the step's optimizer steps).

Peaks are read from :class:`tidal.logging.memory_peaks.DevicePeaks`, the one owner of the allocator's peak
counter (this module never resets it).
- ``engine_{weights,kv_cache,graphs}_gib``: the rollout engine's own memory while it generated
  (:meth:`tidal.engine.base.RolloutEngine.memory_report`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from tidal.logging.memory_peaks import DevicePeaks

GIB = 2**30


class MemoryParts:
    """Collects one step's memory parts. ``peaks``: the run's :class:`DevicePeaks` (the timer's
    observer); ``resident_bytes(state)``: a trained model's bytes on the device by kind
    (``weights``, ``optimizer``), the Strategy's :meth:`resident_bytes`."""

    def __init__(self, peaks: DevicePeaks, resident_bytes: Callable[..., dict[str, int]]):
        self.peaks = peaks
        self.device = peaks.device
        self._resident_bytes = resident_bytes
        self.bytes: dict[str, int] = {}  # "<role>_<kind>" -> bytes, this step

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def update(self, role: str, state) -> Iterator[None]:
        """Around one optimizer step of ``role``'s ``state`` (its model and optimizer state already
        on the device): its activation peak, then what it holds at the end (an optimizer's state
        exists after its first step). An update that raises records nothing."""
        with self.peaks.scope(f"{role}_update") as peak:
            yield
        if self._cuda:
            key = f"{role}_activations_peak"
            self.bytes[key] = max(self.bytes.get(key, 0), peak.above_start)
        for kind, n in self._resident_bytes(state).items():
            self.bytes[f"{role}_{kind}"] = n

    def pop(self, engine_memory: dict[str, int]) -> dict[str, float]:
        """The step's ``memory/*`` metrics (empty off CUDA), and a new step begins. ``engine_memory``:
        the engine's bytes by kind at the end of its last rollout."""
        parts, self.bytes = self.bytes, {}
        _, step = self.peaks.pop()
        if step is None:
            return {}
        peak = step.allocated
        free, total = torch.cuda.mem_get_info(self.device)
        metrics = {"memory/peak_allocated_gib": peak / GIB, "memory/reserved_gib": torch.cuda.memory_reserved(self.device) / GIB,
                   "memory/device_used_gib": (total - free) / GIB}
        metrics.update({f"memory/{key}_gib": n / GIB for key, n in parts.items()})
        metrics.update({f"memory/engine_{kind}_gib": n / GIB for kind, n in engine_memory.items()})
        return metrics
