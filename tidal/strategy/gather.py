"""Full tensors of dim-0-sharded DTensor parameters (FSDP2, and HSDP's 2-D layout), gathered in buckets.

``DTensor.full_tensor()`` per parameter costs one collective and a few hundred microseconds of
host work each; a 0.5B model has ~300 parameters, so a weight sync spent most of its time there.
:class:`BucketedFullTensors` is a drop-in ``full(param)`` for :func:`tidal.models.lora.hf_weights`
that gathers consecutive parameters (``named_parameters`` order) together: one
``all_gather_into_tensor`` per bucket of about ``bucket_bytes`` local bytes. On a mesh of one rank
the local shard is the full tensor and nothing is gathered or copied.

Contract: every rank calls with the same parameters in the same order (the bucket plan depends on
the request order and the shapes only, identical everywhere). Requests out of
``named_parameters`` order are fine (a cached tensor is returned once, then dropped), so at most
about two buckets of full tensors are alive at a time.

Layout: a ``Shard(0)`` DTensor of global dim-0 size ``d`` on ``W`` ranks holds rows
``[r*c, min((r+1)*c, d))`` on rank ``r``, ``c = ceil(d / W)`` (``torch.chunk``); each shard is
padded to ``c`` rows for the collective and the padding dropped after. Under hybrid sharding (a 2-D
mesh, placements ``(Replicate(), Shard(0))``) the same holds within the rank's shard group (the
mesh's last dimension, ``W`` its size): the gather runs there, never across replicas.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


def _dim0_sharded(p: torch.Tensor) -> bool:
    """Sharded on dim 0 over the mesh's last dimension, replicated over any other (FSDP2, HSDP)."""
    if not isinstance(p, DTensor):
        return False
    *outer, last = p.placements
    return last == Shard(0) and all(isinstance(q, Replicate) for q in outer)


def _shard_dim(p: DTensor) -> tuple[int, dist.ProcessGroup]:
    """The size and process group of the mesh dimension ``p`` is sharded over (the last)."""
    mesh = p.device_mesh
    return mesh.size(mesh.ndim - 1), mesh.get_group(mesh.ndim - 1)


class BucketedFullTensors:
    def __init__(self, model: torch.nn.Module, device: torch.device, bucket_bytes: int = 256 << 20):
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.order = [p for _, p in model.named_parameters()]
        self.index = {id(p): i for i, p in enumerate(self.order)}
        self.cache: dict[int, torch.Tensor] = {}
        self.done: set[int] = set()
        self.collectives = 0  # for tests and benchmarks

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        key = id(p)
        if key in self.cache:
            return self.cache.pop(key)
        if not _dim0_sharded(p):
            return (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to(self.device)
        if _shard_dim(p)[0] == 1:  # the local shard is the whole tensor (not to_local(): an autograd call)
            return p._local_tensor.detach().to(self.device)
        bucket = self._bucket_from(p)
        for q, full in zip(bucket, self._gather(bucket)):
            self.done.add(id(q))
            self.cache[id(q)] = full
        return self.cache.pop(key)

    def _bucket_from(self, p: torch.Tensor) -> list[torch.Tensor]:
        """``p`` and the following not-yet-gathered parameters of its mesh and dtype, up to the byte budget."""
        bucket, size = [p], p.to_local().numel() * p.element_size()
        for q in self.order[self.index.get(id(p), len(self.order)) + 1 :]:
            if size >= self.bucket_bytes:
                break
            if id(q) in self.done or not _dim0_sharded(q) or q.device_mesh != p.device_mesh or q.dtype != p.dtype:
                continue
            bucket.append(q)
            size += q.to_local().numel() * q.element_size()
        return bucket

    def _gather(self, bucket: list[torch.Tensor]) -> list[torch.Tensor]:
        world, group = _shard_dim(bucket[0])
        rows = [math.ceil(q.shape[0] / world) for q in bucket]
        inner = [math.prod(q.shape[1:]) for q in bucket]
        send = torch.zeros(sum(r * i for r, i in zip(rows, inner)), dtype=bucket[0].dtype, device=self.device)
        off = 0
        for q, r, i in zip(bucket, rows, inner):
            local = q.to_local().detach().reshape(-1)
            send[off : off + local.numel()] = local
            off += r * i
        recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
        dist.all_gather_into_tensor(recv, send, group=group)
        self.collectives += 1
        recv_WN = recv.view(world, send.numel())
        out, off = [], 0
        for q, r, i in zip(bucket, rows, inner):
            full = recv_WN[:, off : off + r * i].reshape(world * r, *q.shape[1:])[: q.shape[0]]
            out.append(full.contiguous())
            off += r * i
        return out
