"""Host memory: how much there is, and page-locked buffers of exactly the size asked for.

:func:`host_memory` reads the memory this process may use: the cgroup limit (v2 ``memory.max`` or
v1 ``memory.limit_in_bytes``) when there is one, else ``MemTotal`` of ``/proc/meminfo``. Some
virtual machines report a ``MemTotal`` far below their real memory at start (it grows as memory is
used): without a cgroup limit a run there passes the real size (``memory.host_memory_gib``).

:class:`PinnedBuffer` is one block of host memory, page-locked on CUDA machines by registering an
ordinary allocation with the driver (``cudaHostRegister``, as torch's own checkpoint stager does):
it takes exactly the bytes asked for, where ``torch.empty(..., pin_memory=True)`` goes through
PyTorch's caching host allocator, which rounds every block up to a power of two and keeps freed
blocks for reuse (a 61 GB optimizer state can take 64 GB, and a copy made at every engine sleep
stays cached). Copies between a registered buffer and the device are asynchronous like those from
pinned tensors. The buffer is registered while the object lives; views of :attr:`tensor` must not
be used for asynchronous copies after it is gone.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
# cgroup v1 reports "no limit" as a huge page-aligned number
_UNLIMITED = 1 << 60
_PAGE = 4096


def meminfo_total(path: str = "/proc/meminfo") -> int | None:
    """``MemTotal`` in bytes, or None when unreadable."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemTotal:"):
                value, unit = line.split()[1:3]
                return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_limit(paths: tuple[str, ...] = _CGROUP_FILES) -> int | None:
    """This process's cgroup memory limit in bytes, or None when there is none (or it is unreadable)."""
    for p in paths:
        try:
            raw = Path(p).read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        try:
            value = int(raw)
        except ValueError:
            continue
        return value if value < _UNLIMITED else None
    return None


def host_memory(override_gib: float = 0.0, *, meminfo: str = "/proc/meminfo", cgroup_files: tuple[str, ...] = _CGROUP_FILES) -> tuple[int, str]:
    """(bytes, where the figure comes from) of the host memory this process may count on:
    ``override_gib`` > 0, else the cgroup limit when there is one (what the kernel enforces on this
    process; some VMs report a MemTotal that starts low and grows as memory is used), else MemTotal."""
    if override_gib > 0:
        return int(override_gib * 2**30), "memory.host_memory_gib"
    total = meminfo_total(meminfo)
    limit = cgroup_limit(cgroup_files)
    if limit is not None:
        seen = f", MemTotal reads {total / 2**30:.1f} GiB" if total is not None and total != limit else ""
        return limit, f"cgroup memory limit{seen}"
    if total is None:
        raise RuntimeError("cannot read the host's memory (/proc/meminfo, cgroup); set memory.host_memory_gib")
    return total, "MemTotal"


def local_world_size() -> int:
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE; 1 in a plain process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _release(ptr: int, registered: bool, tensor: torch.Tensor) -> None:
    if registered:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    del tensor


class PinnedBuffer:
    """``nbytes`` of host memory (uint8 :attr:`tensor`), page-locked when ``pin`` (CUDA only).
    :meth:`view` hands out typed, shaped views at byte offsets. The registered range is the whole
    pages inside the allocation (it takes at most 8 KiB more than asked), so two buffers never
    register the same page."""

    def __init__(self, nbytes: int, *, pin: bool, zero: bool = False):
        self.nbytes = int(nbytes)
        raw = (torch.zeros if zero else torch.empty)(self.nbytes + 2 * _PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _PAGE
        self.tensor = raw[start : start + self.nbytes]
        self.pinned = bool(pin) and torch.cuda.is_available()
        ptr = raw.data_ptr() + start
        if self.pinned:
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, -(-max(1, self.nbytes) // _PAGE) * _PAGE, 0))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes / 2**30:.2f} GiB of host memory failed (CUDA error {err})")
        weakref.finalize(self, _release, ptr, self.pinned, raw)

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` over the bytes from ``offset`` (aligned to the dtype's size)."""
        n = 1
        for s in shape:
            n *= s
        size = n * dtype.itemsize
        if offset % dtype.itemsize or offset < 0 or offset + size > self.nbytes:
            raise ValueError(f"a view of {size} bytes at {offset} does not fit a {self.nbytes}-byte buffer (or is misaligned)")
        return self.tensor[offset : offset + size].view(dtype).view(tuple(shape))


def _aligned(nbytes: int, align: int = 64) -> int:
    return -(-nbytes // align) * align


class ParamHostCopy:
    """Host copies of a module's parameters in one :class:`PinnedBuffer` sized to them exactly
    (each 64-byte aligned), made at the first :meth:`offload` and reused by every later one (the
    parameters' names, shapes and dtypes must not change). For an engine whose weights move to the
    host while it sleeps."""

    def __init__(self, *, pin: bool):
        self.pin = pin
        self.buffer: PinnedBuffer | None = None
        self._views: dict[str, torch.Tensor] = {}
        self.holds = False  # the parameters' values are here (their device memory is freed)

    def _allocate(self, params: list[tuple[str, torch.Tensor]]) -> None:
        offsets, total = [], 0
        for _, p in params:
            offsets.append(total)
            total += _aligned(p.numel() * p.element_size())
        self.buffer = PinnedBuffer(total, pin=self.pin)
        self._views = {n: self.buffer.view(off, p.shape, p.dtype) for (n, p), off in zip(params, offsets)}

    def offload(self, named_params) -> int:
        """Copy every parameter into its host view and free its device memory (``p.data`` becomes
        an empty tensor on the same device). Returns the device bytes freed."""
        params = list(named_params)
        if self.buffer is None:
            self._allocate(params)
        freed = 0
        for name, p in params:
            view = self._views.get(name)
            if view is None or view.shape != p.shape or view.dtype != p.dtype:
                raise ValueError(f"parameter {name!r} ({tuple(p.shape)}, {p.dtype}) is not the one the host copy was made for")
            view.copy_(p.data)
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.holds = True
        return freed

    def restore(self, named_params, device: torch.device) -> int:
        """Give every parameter back its values on ``device`` (asynchronous copies from pinned memory,
        on the current stream). Returns the bytes restored."""
        restored = 0
        for name, p in named_params:
            p.data = self._views[name].to(device, non_blocking=True)
            restored += p.numel() * p.element_size()
        self.holds = False
        return restored
