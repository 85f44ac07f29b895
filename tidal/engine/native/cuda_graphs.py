"""CUDA graphs of the decode step at bucketed batch sizes, captured lazily on first use.

A graph bakes in the addresses of the weights, the KV cache and its static input buffers: it stays
valid across in-place weight loads, and is dropped (:meth:`free`) whenever the KV cache or the
weights are released. A batch of B rows replays the smallest bucket >= B; padded rows attend to
one token of the scratch block and write their K/V there (with a window pool, of each pool: its own
slot mapping and block tables are static buffers too). Needs a kernel backend whose decode
attention reads the context lengths from device memory (``ops.graph_safe``).

Two kinds of graph, keyed by (bucket, temperature): with a temperature, the step's logits and its
fused sampling (no top-k/top-p: :func:`tidal.engine.sampler.fused_applies`) are in the graph too,
which then yields ``[2, B]`` float64 (token ids, logprobs; zeros on TP ranks other than the first)
and reads each row's uniform from a device buffer filled with the caller's keyed uniforms
(:func:`tidal.engine.sampler.keyed_uniforms`) before each replay, the draw the eager path makes.
Without (temperature None), it yields the final hidden states and the caller samples.
"""

from __future__ import annotations

import numpy as np
import torch

from tidal.engine.native.attention import AttnMetadata


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured up to ``max_bs``: 1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32
    to 1024, of 64 above (a replay pads at most about 1/8 of its rows)."""
    sizes = [1, 2, 4, 8] + list(range(16, 64, 8)) + list(range(64, 256, 16)) + list(range(256, 1024, 32))
    sizes += list(range(1024, max_bs, 64))
    return [b for b in sizes if b < max_bs] + [max_bs]


class DecodeGraphs:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, device: torch.device, window_pool: bool = False):
        self.model = model
        self.window_pool = window_pool
        self.rows = 5 if window_pool else 4  # input rows: ids, positions, slots, context lengths[, window slots]
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        self.device = device
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[tuple[int, float | None], torch.cuda.CUDAGraph] = {}
        self.outs: dict[tuple[int, float | None], torch.Tensor] = {}  # each graph's output (its pool's memory)
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
        self.outs.clear()
        self.pool = None
        self.bufs = None
        self.host = []
        return freed

    def _alloc_buffers(self) -> None:
        n = self.max_bs
        z = lambda *shape, dt: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        self.bufs = {
            "inputs": z(self.rows, n, dt=torch.int64),  # ids, positions, slots, context lengths[, window slots]
            "bt": z(n, self.max_blocks, dt=torch.int32),
            "wbt": z(n if self.window_pool else 0, self.max_blocks, dt=torch.int32),
            "u": z(n, dt=torch.float32),  # each row's uniform (padded rows: 0)
        }
        sink = getattr(self.model, "routing_sink", None)
        if sink is not None:  # MoE: each row's experts, written by the graph (tidal.engine.native.moe.record)
            self.bufs["routing"] = sink.new_buffer(n, self.device)
        self.host = [(torch.zeros(self.rows * n, dtype=torch.int64, pin_memory=True),
                      torch.zeros(n * self.max_blocks, dtype=torch.int32, pin_memory=True),
                      torch.zeros(n, dtype=torch.float32, pin_memory=True),
                      torch.zeros(n * self.max_blocks if self.window_pool else 0, dtype=torch.int32, pin_memory=True))
                     for _ in range(2)]

    def _meta(self, bs: int) -> AttnMetadata:
        inputs = self.bufs["inputs"]
        meta = AttnMetadata(
            is_prefill=False, slot_mapping_T=inputs[2, :bs], block_tables_BN=self.bufs["bt"][:bs],
            context_lens_B=inputs[3, :bs], max_context_len=1,
        )
        if self.window_pool:
            meta.window = AttnMetadata(is_prefill=False, slot_mapping_T=inputs[4, :bs], block_tables_BN=self.bufs["wbt"][:bs],
                                       context_lens_B=inputs[3, :bs], max_context_len=1)
        return meta

    def _step(self, bs: int, temperature: float | None) -> torch.Tensor:
        inputs, meta = self.bufs["inputs"], self._meta(bs)
        sink = getattr(self.model, "routing_sink", None)
        if sink is not None:
            sink.buf = self.bufs["routing"][:bs]
        hidden_BH = self.model(inputs[0, :bs], inputs[1, :bs], meta)
        if sink is not None:
            sink.buf = None
        if temperature is None:
            return hidden_BH
        from tidal.engine.native.kernels.triton_sampling import fused_sample

        out_2B = torch.zeros(2, bs, dtype=torch.float64, device=self.device)
        logits_BV = self.model.compute_logits(hidden_BH)
        if logits_BV is not None:  # TP rank 0
            token_B, logp_B = fused_sample(logits_BV, temperature, self.bufs["u"][:bs])
            out_2B[0], out_2B[1] = token_B, logp_B
        return out_2B

    def _capture(self, key: tuple[int, float | None]) -> torch.cuda.CUDAGraph:
        bs, temperature = key
        self._step(bs, temperature)  # warm-up (JIT, autotune) outside the graph
        torch.cuda.synchronize(self.device)
        # capture_begin/end rather than the torch.cuda.graph context, which collects garbage and
        # empties the allocator cache first: that would hand back the trainer's cached blocks on
        # every wake-up (the graph pool is private, so the reserved-bytes delta stays exact)
        before = torch.cuda.memory_reserved(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool)
            try:
                self.outs[key] = self._step(bs, temperature)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        return graph

    def run(self, inputs: np.ndarray, bt: np.ndarray, scratch_block: int, ids_dev=None,
            temperature: float | None = None, uniforms: np.ndarray | None = None,
            window_bt: np.ndarray | None = None, window_scratch: int = 0) -> torch.Tensor:
        """Replay the bucket for ``B`` rows: ``inputs`` ``[4, B]`` (input token, position, cache slot,
        context length; with a window pool a fifth row, the slot in it), ``bt`` the block tables
        ``[B, width]`` (``window_bt``: the window pool's, whose scratch block is ``window_scratch``);
        input tokens from ``ids_dev`` on the device if given. Returns the final hidden states ``[B, H]``, or with ``temperature`` the samples
        ``[2, B]`` (a view of the graph's output, valid until the next replay), the row's token drawn
        with ``uniforms[b]`` (fp32 ``[B]``; None on TP ranks other than the first: their graphs do
        not sample)."""
        n = inputs.shape[1]
        bs = next(b for b in self.buckets if b >= n)
        if self.bufs is None:
            before = torch.cuda.memory_reserved(self.device)
            self._alloc_buffers()
            self.bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        host_flat, host_bt, host_u, host_wbt = self.host[self.parity]
        self.parity ^= 1
        host = host_flat[: self.rows * bs].view(self.rows, bs)  # contiguous, so the copy below stays asynchronous
        staged = host.numpy()
        staged[:, :n] = inputs
        page = self.model.layer_attentions()[0].k_cache.shape[1]
        pad = [[0], [0], [scratch_block * page], [1]] + ([[window_scratch * page]] if self.window_pool else [])
        staged[:, n:bs] = np.array(pad)
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
        if self.window_pool:
            host_wbt.numpy()[: n * w] = window_bt.reshape(-1)
            wbt_dev = self.bufs["wbt"]
            wbt_dev[:n, :w].copy_(host_wbt[: n * w].view(n, w), non_blocking=True)
            if bs > n:
                wbt_dev[n:bs, 0] = window_scratch
        key = (bs, temperature)
        if key not in self.graphs:
            self.graphs[key] = self._capture(key)
        if temperature is not None and uniforms is not None:
            staged_u = host_u[:bs]
            staged_u.numpy()[:n] = uniforms
            staged_u.numpy()[n:] = 0.0
            self.bufs["u"][:bs].copy_(staged_u, non_blocking=True)
        self.graphs[key].replay()
        out = self.outs[key]
        return out[:n] if temperature is None else out[:, :n]
