"""Frozen models parked in host memory between uses (``offload_model``/``reload_model`` of a model
none of whose parameters trains: the reference model, a reward model).

Parking frees the device memory of every parameter and buffer in place: each device storage is
resized to zero bytes, so the tensor objects, their views and their owners' bookkeeping (FSDP2's
sharded parameters are views into one padded tensor each) stay as they are, as FSDP2 itself does
with unsharded parameters. Its bytes wait in a host copy, pinned on CUDA, made on the first park
and again only when a tensor was written in place since (its version counter moved): a frozen
model's later parks copy nothing back. Unparking re-allocates each storage and copies the bytes
back asynchronously, on the current stream.

While parked the tensors must not be read: the model is reloaded before any forward. State dicts
of parked models are not available (frozen models are not checkpointed).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch
from torch.distributed.tensor import DTensor


@dataclasses.dataclass
class _Parked:
    storage: torch.UntypedStorage  # the device storage (0 bytes while parked)
    host: torch.UntypedStorage  # its bytes
    nbytes: int
    tensors: list[torch.Tensor]  # the tensors viewing it (for the version check)
    versions: tuple[int, ...]  # their versions when ``host`` was written


def _device_tensors(model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    """The plain tensors on ``device`` holding the model's parameters and buffers (a DTensor's
    local shard)."""
    out = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        if isinstance(t, DTensor):
            t = t._local_tensor  # not .data: that would have a version counter of its own
        if t.device.type == device.type and t.numel():
            out.append(t)
    return out


class ModelParking:
    """Parks and unparks frozen models whose tensors live on ``device``; holds their host copies
    (one per device storage; pinned on CUDA). A CPU "device" is allowed (the tests use it)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._parked: weakref.WeakKeyDictionary[torch.nn.Module, list[_Parked]] = weakref.WeakKeyDictionary()
        self.copies_to_host = 0  # storages copied to host memory (a frozen model: once)

    def is_parked(self, model: torch.nn.Module) -> bool:
        entries = self._parked.get(model)
        return bool(entries) and entries[0].storage.nbytes() == 0

    def park(self, model: torch.nn.Module) -> int:
        """Free the device memory of ``model``'s parameters and buffers. Returns the bytes freed."""
        if self.is_parked(model):
            return 0
        entries = self._parked.get(model)
        if entries is None:
            entries = self._parked[model] = self._entries(model)
        freed, copied = 0, False
        for e in entries:
            versions = tuple(t._version for t in e.tensors)
            if versions != e.versions:  # first park, or written in place since the copy
                e.host.copy_(e.storage, non_blocking=True)
                e.versions = versions
                self.copies_to_host += 1
                copied = True
            freed += e.nbytes
        if copied and self.device.type == "cuda":
            # the host copies must be complete before anything reads them (unpark, on whatever
            # stream is current then) and before the storages they read are reused
            torch.cuda.synchronize(self.device)
        for e in entries:
            e.storage.resize_(0)
        return freed

    def unpark(self, model: torch.nn.Module) -> int:
        """Bring ``model``'s parameters and buffers back to the device. Returns the bytes restored."""
        if not self.is_parked(model):
            return 0
        restored = 0
        for e in self._parked[model]:
            e.storage.resize_(e.nbytes)
            e.storage.copy_(e.host, non_blocking=True)
            restored += e.nbytes
        return restored

    def _entries(self, model: torch.nn.Module) -> list[_Parked]:
        by_storage: dict[int, _Parked] = {}
        for t in _device_tensors(model, self.device):
            st = t.untyped_storage()
            e = by_storage.get(st.data_ptr())
            if e is None:
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
                e = by_storage[st.data_ptr()] = _Parked(st, host, st.nbytes(), [], versions=(-1,))  # never copied
            e.tensors.append(t)
        return list(by_storage.values())
