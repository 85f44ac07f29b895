"""What a trained model holds on a device: bytes of the storages behind its tensors, measured
(:func:`device_bytes`), and as each backend describes them before anything loads
(:class:`TrainedBytes`, from the backend's layout: ``FSDP2Layout`` in :mod:`tidal.strategy.fsdp2`,
``DeepSpeedLayout`` in :mod:`tidal.strategy.deepspeed`; the memory plan composes them).

A sharded tensor counts its local shard (a DTensor's ``to_local()``: FSDP2), a storage shared by
several tensors (views, tied weights, a flat buffer's partitions) once, and a storage on another
device (offloaded to the host) not at all.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when one of them names no index."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def device_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` that live on ``device`` (whole storages:
    an FSDP2 shard's padding and a flat buffer's every partition are held, so they count)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not same_device(t.device, device):
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    """The tensors of a torch optimizer's per-parameter state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    for st in optimizer.state.values():
        yield from (v for v in st.values() if isinstance(v, torch.Tensor))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainedBytes:
    """A trained model's bytes on one rank as its backend keeps them. ``weights``: on the device at
    rest (with what the optimizer keeps beside them there, e.g. ZeRO's fp32 masters);
    ``grads``: gradients after a step's reduction; ``grads_accumulating``: while micro-batches
    accumulate before it; ``optimizer_device`` / ``optimizer_host``: optimizer state on the device /
    in host memory; ``optimizer_staging``: device buffers of the step; ``host_label``: what the
    host holds, in words."""

    weights: int
    grads: int
    grads_accumulating: int
    optimizer_device: int
    optimizer_host: int
    optimizer_staging: int = 0
    host_label: str = ""
