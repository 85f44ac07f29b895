"""CUDA graphs of the decode forward at bucketed batch sizes, captured lazily on first use.

A graph bakes in the addresses of the weights, the KV cache and its static input buffers: it stays
valid across in-place weight loads, and is dropped (:meth:`free`) whenever the KV cache or the
weights are released. A batch of B rows replays the smallest bucket >= B; padded rows attend to
one token of the scratch block and write their K/V there. Needs a kernel backend whose decode
attention reads the context lengths from device memory (``ops.graph_safe``).
"""

from __future__ import annotations

import numpy as np
import torch

from tidal.engine.native.attention import AttnMetadata


def graph_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 1025, 32))
    return [b for b in sizes if b < max_bs] + [max_bs]


class DecodeGraphs:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        self.device = device
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.bufs: dict[str, torch.Tensor] | None = None
        self.host: torch.Tensor | None = None
        self.bytes = 0

    def fits(self, n: int) -> bool:
        return n <= self.max_bs

    def free(self) -> int:
        """Drop every graph and static buffer. Returns the device bytes they held (measured at capture)."""
        freed, self.bytes = self.bytes, 0
        self.graphs.clear()
        self.pool = None
        self.bufs = None
        self.host = None
        return freed

    def _alloc_buffers(self) -> None:
        n, h = self.max_bs, self.model.config.hidden_size
        z = lambda *shape, dt: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        self.bufs = {
            "inputs": z(4, n, dt=torch.int64),  # ids, positions, slots, context lengths
            "bt": z(n, self.max_blocks, dt=torch.int32),
            "hidden": z(n, h, dt=self.model.cos_sin_PD.dtype),
        }
        self.host = torch.zeros(4, n, dtype=torch.int64, pin_memory=True)

    def _meta(self, bs: int) -> AttnMetadata:
        inputs = self.bufs["inputs"]
        return AttnMetadata(
            is_prefill=False, slot_mapping_T=inputs[2, :bs], block_tables_BN=self.bufs["bt"][:bs],
            context_lens_B=inputs[3, :bs], max_context_len=1,
        )

    def _capture(self, bs: int) -> torch.cuda.CUDAGraph:
        before = torch.cuda.memory_reserved(self.device)
        inputs, meta = self.bufs["inputs"], self._meta(bs)
        self.bufs["hidden"][:bs] = self.model(inputs[0, :bs], inputs[1, :bs], meta)  # warm-up (JIT, autotune)
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.bufs["hidden"][:bs] = self.model(inputs[0, :bs], inputs[1, :bs], meta)
        torch.cuda.synchronize(self.device)
        self.bytes += torch.cuda.memory_reserved(self.device) - before
        return graph

    def run(self, ids, pos, slots, ctxs, bt: np.ndarray, scratch_block: int) -> torch.Tensor:
        """Replay the bucket for ``len(ids)`` rows; returns the final hidden states ``[B, H]``."""
        n = len(ids)
        bs = next(b for b in self.buckets if b >= n)
        if self.bufs is None:
            before = torch.cuda.memory_reserved(self.device)
            self._alloc_buffers()
            self.bytes += torch.cuda.memory_reserved(self.device) - before
        host = self.host
        host[0, :n] = torch.as_tensor(ids)
        host[1, :n] = torch.as_tensor(pos)
        host[2, :n] = torch.as_tensor(slots)
        host[3, :n] = torch.as_tensor(ctxs)
        bs_block = self.model.layer_attentions()[0].k_cache.shape[1]
        host[:, n:bs] = torch.tensor([[0], [0], [scratch_block * bs_block], [1]])
        inputs = self.bufs["inputs"]
        inputs[:, :bs].copy_(host[:, :bs], non_blocking=True)
        bt_dev = self.bufs["bt"]
        bt_dev[:n, : bt.shape[1]].copy_(torch.from_numpy(bt), non_blocking=True)
        bt_dev[n:bs, 0] = scratch_block
        if bs not in self.graphs:
            self.graphs[bs] = self._capture(bs)
        self.graphs[bs].replay()
        return self.bufs["hidden"][:n]
