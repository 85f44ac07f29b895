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
- ``engine_{weights,kv_cache,graphs}_gib``: the rollout engine's own memory while it generated
  (:meth:`tidal.engine.base.RolloutEngine.memory_report`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

GIB = 2**30


class MemoryParts:
    """Collects one step's memory parts. ``resident_bytes(state)``: a trained model's bytes on the
    device by kind (``weights``, ``optimizer``), the Strategy's :meth:`resident_bytes`."""

    def __init__(self, device: torch.device, resident_bytes: Callable[..., dict[str, int]]):
        self.device = device
        self._resident_bytes = resident_bytes
        self.bytes: dict[str, int] = {}  # "<role>_<kind>" -> bytes, this step
        self._peak = 0  # the allocator's peak before the updates reset it, this step

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def update(self, role: str, state) -> Iterator[None]:
        """Around one optimizer step of ``role``'s ``state`` (its model and optimizer state already
        on the device): its activation peak, then what it holds at the end (an optimizer's state
        exists after its first step). An update that raises records nothing."""
        if self._cuda:
            start = torch.cuda.memory_allocated(self.device)
            self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        if self._cuda:
            key = f"{role}_activations_peak"
            self.bytes[key] = max(self.bytes.get(key, 0), torch.cuda.max_memory_allocated(self.device) - start)
        for kind, n in self._resident_bytes(state).items():
            self.bytes[f"{role}_{kind}"] = n

    def pop(self, engine_memory: dict[str, int]) -> dict[str, float]:
        """The step's ``memory/*`` metrics (empty off CUDA), and a new step begins. ``engine_memory``:
        the engine's bytes by kind at the end of its last rollout."""
        parts, self.bytes = self.bytes, {}
        if not self._cuda:
            return {}
        peak, self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device)), 0
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        metrics = {"memory/peak_allocated_gib": peak / GIB, "memory/reserved_gib": torch.cuda.memory_reserved(self.device) / GIB,
                   "memory/device_used_gib": (total - free) / GIB}
        metrics.update({f"memory/{key}_gib": n / GIB for key, n in parts.items()})
        metrics.update({f"memory/engine_{kind}_gib": n / GIB for kind, n in engine_memory.items()})
        return metrics
