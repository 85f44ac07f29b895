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
        # two pinned staging buffers, alternated: the copy out of one may still be queued behind the
        # step in flight while the next step's inputs are written into the other
        self.host: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.parity = 0
        self.bytes = 0

    def fits(self, n: int) -> bool:
        return n <= self.max_bs

    def free(self) -> int:
        """Drop every graph and static buffer. Returns the device bytes they held (measured at capture)."""
        freed, self.bytes = self.bytes, 0
        self.graphs.clear()
        self.pool = None
        self.bufs = None
        self.host = []
        return freed

    def _alloc_buffers(self) -> None:
        n, h = self.max_bs, self.model.config.hidden_size
        z = lambda *shape, dt: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        self.bufs = {
            "inputs": z(4, n, dt=torch.int64),  # ids, positions, slots, context lengths
            "bt": z(n, self.max_blocks, dt=torch.int32),
            "hidden": z(n, h, dt=self.model.cos_sin_PD.dtype),
        }
        self.host = [(torch.zeros(4 * n, dtype=torch.int64, pin_memory=True),
                      torch.zeros(n * self.max_blocks, dtype=torch.int32, pin_memory=True)) for _ in range(2)]

    def _meta(self, bs: int) -> AttnMetadata:
        inputs = self.bufs["inputs"]
        return AttnMetadata(
            is_prefill=False, slot_mapping_T=inputs[2, :bs], block_tables_BN=self.bufs["bt"][:bs],
            context_lens_B=inputs[3, :bs], max_context_len=1,
        )

    def _capture(self, bs: int) -> torch.cuda.CUDAGraph:
        # torch.cuda.graph empties the allocator cache on entry: do it first so the reserved-bytes
        # delta is the graph pool's growth alone
        torch.cuda.empty_cache()
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
        self.bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        return graph

    def run(self, ids, pos, slots, ctxs, bt: np.ndarray, scratch_block: int, ids_dev=None) -> torch.Tensor:
        """Replay the bucket for ``len(ids)`` rows (input tokens ``ids_dev`` on the device if given);
        returns the final hidden states ``[B, H]``."""
        n = len(ids)
        bs = next(b for b in self.buckets if b >= n)
        if self.bufs is None:
            before = torch.cuda.memory_reserved(self.device)
            self._alloc_buffers()
            self.bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        host_flat, host_bt = self.host[self.parity]
        self.parity ^= 1
        host = host_flat[: 4 * bs].view(4, bs)  # contiguous, so the copy below stays asynchronous
        staged = host.numpy()
        staged[0, :n] = ids
        staged[1, :n] = pos
        staged[2, :n] = slots
        staged[3, :n] = ctxs
        page = self.model.layer_attentions()[0].k_cache.shape[1]
        staged[:, n:bs] = np.array([[0], [0], [scratch_block * page], [1]])
        inputs = self.bufs["inputs"]
        inputs[:, :bs].copy_(host, non_blocking=True)
        if ids_dev is not None:
            inputs[0, :n].copy_(ids_dev)
        w = bt.shape[1]
        host_bt.numpy()[: n * w] = bt.reshape(-1)
        bt_dev = self.bufs["bt"]
        bt_dev[:n, :w].copy_(host_bt[: n * w].view(n, w), non_blocking=True)
        if bs > n:
            bt_dev[n:bs, 0] = scratch_block
        if bs not in self.graphs:
            self.graphs[bs] = self._capture(bs)
        self.graphs[bs].replay()
        return self.bufs["hidden"][:n]
