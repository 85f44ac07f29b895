"""Device memory that keeps its virtual addresses while its physical memory goes back to the driver.

The decode CUDA graphs bake in the addresses of every layer's K and V cache. Through the CUDA
driver's virtual memory management (``cuMemAddressReserve`` once, then ``cuMemCreate`` +
``cuMemMap`` on each :meth:`FixedAddressRegions.map`, ``cuMemUnmap`` + ``cuMemRelease`` on each
:meth:`~FixedAddressRegions.unmap`) the KV cache comes back at the same addresses after every
sleep, so the graphs are captured once and stay valid, while the memory itself is free for training
between rollouts. Each layer's K (and V) cache gets its own region, reserved as large as the device
could ever hold and backed only up to the blocks of this wake-up: the cache follows the memory free
at each wake-up while every block keeps its address (block ``i`` of a layer is at the same place
whatever the count; blocks beyond the mapped count are never used). Called through ctypes on
``libcuda``; :func:`supported` is False where the driver, the device or the platform lacks it, and
the caller then allocates normally.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_PROT_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1
_ATTR_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_SIGNATURES = {
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_AllocProp), ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64],
    "cuMemAddressFree": [ctypes.c_uint64, ctypes.c_size_t],
    "cuMemCreate": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(_AllocProp), ctypes.c_uint64],
    "cuMemRelease": [ctypes.c_uint64],
    "cuMemMap": [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64],
    "cuMemUnmap": [ctypes.c_uint64, ctypes.c_size_t],
    "cuMemSetAccess": [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != _CUDA_SUCCESS:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA driver error {result} ({(msg.value or b'?').decode()})")


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device whose driver offers virtual memory management."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.init()
        drv = _driver()
        dev, flag = ctypes.c_int(), ctypes.c_int()
        if drv.cuDeviceGet(ctypes.byref(dev), _index(device)) != _CUDA_SUCCESS:
            return False
        return drv.cuDeviceGetAttribute(ctypes.byref(flag), _ATTR_VMM_SUPPORTED, dev) == _CUDA_SUCCESS and flag.value == 1
    except (OSError, AttributeError):  # no libcuda, or a driver without these entry points
        return False


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _CudaArray:
    """A ``__cuda_array_interface__`` over raw device bytes, for a zero-copy ``torch.as_tensor``; the
    tensor keeps this object, and so ``owner``, alive."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def device_total_bytes(device: torch.device) -> int:
    """The device's memory size (the most a KV cache can ever take)."""
    return torch.cuda.get_device_properties(_index(device)).total_memory


class FixedAddressRegions:
    """``num_regions`` ranges of device memory at virtual addresses fixed for this object's life, each
    reserved at ``region_bytes`` (rounded up to the driver's granularity) and backed on demand.

    :meth:`map` backs the first ``nbytes`` of every region with new physical memory (one allocation
    per region, rounded up to the granularity; PyTorch's allocator cache is emptied first when the
    driver has too little free) and returns one uint8 tensor over each (contents undefined);
    ``nbytes`` may differ from one map to the next, the regions' addresses do not.
    :meth:`unmap` gives the physical memory back to the driver. Between the two no tensor over a
    region may be used (the caller drops them; unmap synchronizes the device first). :meth:`map`
    raises :class:`torch.OutOfMemoryError` when the driver has no memory to map. The tensors keep
    this object alive; once the last reference goes, the ranges are unmapped and freed.
    """

    def __init__(self, num_regions: int, region_bytes: int, device: torch.device):
        self.device = torch.device("cuda", _index(device))
        self._prop = _AllocProp(type=_ALLOCATION_TYPE_PINNED, location=_Location(_LOCATION_TYPE_DEVICE, self.device.index))
        drv = _driver()
        gran = ctypes.c_size_t()
        _check(drv.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop), _GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity")
        self.granularity = gran.value
        self.num_regions = num_regions
        self.region_bytes = self.round_up(region_bytes)
        ptr = ctypes.c_uint64()
        _check(drv.cuMemAddressReserve(ctypes.byref(ptr), num_regions * self.region_bytes, self.granularity, 0, 0),
               "cuMemAddressReserve")
        self.ptr = ptr.value
        self._handles: list[int] = []
        self.mapped_bytes = 0  # per region

    def round_up(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity) * self.granularity

    @property
    def mapped(self) -> bool:
        return bool(self._handles)

    def region_ptr(self, r: int) -> int:
        return self.ptr + r * self.region_bytes

    def map(self, nbytes: int) -> list[torch.Tensor]:
        assert not self.mapped and self.ptr, "map() on a mapped or closed range"
        size = self.round_up(nbytes)
        if size > self.region_bytes:
            raise ValueError(f"cannot map {size} bytes per region: each region holds {self.region_bytes}")
        if self.num_regions * size > torch.cuda.mem_get_info(self.device)[0]:
            torch.cuda.empty_cache()  # the memory sits in PyTorch's allocator cache: hand it back to the driver
        drv = _driver()
        access = _AccessDesc(location=_Location(_LOCATION_TYPE_DEVICE, self.device.index), flags=_ACCESS_PROT_READWRITE)
        self.mapped_bytes = size
        try:
            for r in range(self.num_regions):
                handle = ctypes.c_uint64()
                result = drv.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), 0)
                if result == _CUDA_ERROR_OUT_OF_MEMORY:
                    raise torch.OutOfMemoryError(
                        f"cannot map {self.num_regions} x {size / 2**30:.3f} GiB on {self.device}: out of device memory")
                _check(result, "cuMemCreate")
                try:
                    _check(drv.cuMemMap(self.region_ptr(r), size, 0, handle.value, 0), "cuMemMap")
                except RuntimeError:
                    drv.cuMemRelease(handle.value)
                    raise
                self._handles.append(handle.value)
                _check(drv.cuMemSetAccess(self.region_ptr(r), size, ctypes.byref(access), 1), "cuMemSetAccess")
        except (RuntimeError, torch.OutOfMemoryError):
            self.unmap()
            raise
        return [torch.as_tensor(_CudaArray(self.region_ptr(r), nbytes, self), device=self.device)
                for r in range(self.num_regions)]

    def unmap(self) -> None:
        if not self._handles:
            return
        torch.cuda.synchronize(self.device)
        drv = _driver()
        handles, self._handles = self._handles, []
        for r, handle in enumerate(handles):
            _check(drv.cuMemUnmap(self.region_ptr(r), self.mapped_bytes), "cuMemUnmap")
            _check(drv.cuMemRelease(handle), "cuMemRelease")
        self.mapped_bytes = 0

    def close(self) -> None:
        """Unmap and give the address ranges back (the object is unusable afterwards)."""
        if self.ptr:
            self.unmap()
            _check(_driver().cuMemAddressFree(self.ptr, self.num_regions * self.region_bytes), "cuMemAddressFree")
            self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown or a dead context: the driver frees it with the process
            pass
