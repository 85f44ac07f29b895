"""Frozen models parked in host memory between uses (``offload_model``/``reload_model`` of a model
none of whose parameters trains: the reference model, a reward model).

Parking frees the device memory of every parameter and buffer in place: each device storage is
resized to zero bytes, so the tensor objects, their views and their owners' bookkeeping (FSDP2's
sharded parameters are views into one padded tensor each) stay as they are, as FSDP2 itself does
with unsharded parameters. Its bytes wait in a host copy, made on the first park and again only
when a tensor was written in place since (its version counter moved): a frozen model's later parks
copy nothing back. A model's host copies share one :class:`~tidal.host_memory.PinnedBuffer` of
exactly their size (page-locked on CUDA; not one caching-allocator block per storage, each rounded
up to a power of two). Unparking re-allocates each storage and copies the bytes back
asynchronously, on the current stream.

While parked the tensors must not be read: the model is reloaded before any forward. State dicts
of parked models are not available (frozen models are not checkpointed).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch
from torch.distributed.tensor import DTensor

from tidal.host_memory import PinnedBuffer


@dataclasses.dataclass
class _Parked:
    storage: torch.UntypedStorage  # the device storage (0 bytes while parked)
    host: torch.Tensor  # its bytes (uint8, a view of the model's host buffer)
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
        self._buffers: weakref.WeakKeyDictionary[torch.nn.Module, PinnedBuffer] = weakref.WeakKeyDictionary()
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
            self._buffers[model] = self._host_buffer(entries)
        freed, copied = 0, False
        for e in entries:
            versions = tuple(t._version for t in e.tensors)
            if versions != e.versions:  # first park, or written in place since the copy
                e.host.copy_(_bytes_of(e.storage), non_blocking=True)
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
            _bytes_of(e.storage).copy_(e.host, non_blocking=True)
            restored += e.nbytes
        return restored

    def host_bytes(self, model: torch.nn.Module) -> int:
        """Host bytes held for ``model`` (0 if it was never parked)."""
        buf = self._buffers.get(model)
        return buf.nbytes if buf is not None else 0

    def _entries(self, model: torch.nn.Module) -> list[_Parked]:
        by_storage: dict[int, _Parked] = {}
        for t in _device_tensors(model, self.device):
            st = t.untyped_storage()
            e = by_storage.get(st.data_ptr())
            if e is None:  # host view assigned by _host_buffer; versions (-1,): never copied
                e = by_storage[st.data_ptr()] = _Parked(st, torch.empty(0, dtype=torch.uint8), st.nbytes(), [], versions=(-1,))
            e.tensors.append(t)
        return list(by_storage.values())

    def _host_buffer(self, entries: list[_Parked]) -> PinnedBuffer:
        """One host buffer for all of a model's storages (each at a 64-byte aligned offset)."""
        offsets, total = [], 0
        for e in entries:
            offsets.append(total)
            total += -(-e.nbytes // 64) * 64
        buf = PinnedBuffer(total, pin=self.pin)
        for e, off in zip(entries, offsets):
            e.host = buf.view(off, (e.nbytes,), torch.uint8)
        return buf


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
