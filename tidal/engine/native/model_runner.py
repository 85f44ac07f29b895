"""Runs one scheduled step on the device: builds the flat inputs and attention metadata, runs the model
(eagerly, or by replaying a captured decode graph), samples on TP rank 0 and shares the result.

Inputs are built from the :class:`SequenceTable`'s per-slot arrays with vectorized numpy (a decode
step of thousands of rows is a few gathers and one host-to-device copy of ids, positions, slots and
context lengths, plus one of the block tables); the sampled tokens come back as numpy arrays.

Owns the KV cache: per attention layer (``model.layer_attentions()``) a K and a V tensor
``[num_blocks + 1, block_size, H_kv, D]``; the extra last block is a scratch block that padded rows
of a CUDA-graph batch write into. A model with both full-attention and sliding-window layers keeps
two pools (:mod:`~tidal.engine.native.window_blocks`): the full layers' tensors have
``num_blocks + 1`` blocks, the window layers' ``window_blocks + 1``, addressed through the table's
``window_table`` (each step carries both slot mappings and block tables; a window layer's attention
reads its own, :meth:`PagedAttention.meta_of`). On CPU every step checks that each slot and block id
it hands the kernels lies inside its pool (an index that leaves its pool fails here, not as a
silent read of another pool's memory on the device). On CUDA with
the driver's virtual memory management each of them lives in its own address region
(:mod:`fixed_memory`): freeing the cache gives its memory back to the driver, allocating it again
maps new memory (as much as this wake-up's block count needs) at the same addresses, and the decode
graphs, which point into it, are kept. Knows nothing about requests or the scheduling policy.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from tidal.engine import sizing
from tidal.engine.native import fixed_memory
from tidal.engine.native.attention import AttnMetadata
from tidal.engine.native.cuda_graphs import DecodeGraphs
from tidal.engine.native.models import PagedLM
from tidal.engine.native.moe.record import RoutingRecorder
from tidal.engine.native.parallel import TPGroup
from tidal.engine.native.scheduler import Batch
from tidal.engine.native.sequence import SequenceTable
from tidal.engine.native.state_pool import StatePool
from tidal.engine.native.speculative.acceptance import VOID, accept
from tidal.engine.sampler import NO_TOKEN, fused_applies, keyed_uniforms, sample
from tidal.exact import exact_numerics
from tidal.sampling_filter import SamplingFilter


class ModelRunner:
    def __init__(self, model: PagedLM, tp: TPGroup, *, block_size: int, device: torch.device,
                 graph_max_batch: int = 0, exact: bool = False):
        """``graph_max_batch``: the largest decode batch replayed from a CUDA graph (0: no graphs);
        larger batches run eagerly. ``exact``: every step runs under :func:`tidal.exact.exact_numerics`
        and samples without the fused Triton pass (exact mode, docs/exact.md)."""
        self.model = model
        self.exact = exact
        self.tp = tp
        self.block_size = block_size
        self.device = device
        attns = model.layer_attentions()  # the layers that keep paged KV (full or sliding window)
        if len({(a.num_kv_heads, a.head_dim) for a in attns}) != 1:
            raise ValueError("the native engine's KV cache needs the same KV heads and head_dim in every attention layer")
        self.kv_shape_tail = (block_size, attns[0].num_kv_heads, attns[0].head_dim)
        windows = [a.window for a in attns if a.window is not None]
        # a pool of their own for the window layers when there are full ones beside them (with window
        # layers alone, every layer's blocks stay in one pool, the window applied by the kernels)
        self.window = max(windows) if windows and len(windows) < len(attns) else None
        self.full_attns = [a for a in attns if self.window is None or a.window is None]
        self.window_attns = [a for a in attns if self.window is not None and a.window is not None]
        self.num_layers = len(self.full_attns)
        self.num_window_layers = len(self.window_attns)
        self.states: StatePool | None = None  # a hybrid model's recurrent-state slots (set by the engine with the KV cache)
        self.kv_dtype = model.cos_sin_PD.dtype
        self.kv_layers: list[torch.Tensor] = []  # K0, V0, K1, V1, ... of the full layers (empty while freed)
        self.window_kv_layers: list[torch.Tensor] = []  # the same for the window layers (their own pool)
        self.num_blocks = 0
        self.num_window_blocks = 0
        self._kv_regions: fixed_memory.FixedAddressRegions | None = None  # the layers' address regions, kept
        self._window_regions: fixed_memory.FixedAddressRegions | None = None
        self.max_blocks_per_seq = (model.max_positions + block_size - 1) // block_size
        self.graphs = DecodeGraphs(model, graph_max_batch, self.max_blocks_per_seq, device,
                                   window_pool=self.window is not None) if graph_max_batch else None
        self._pin = device.type == "cuda"
        self._check = device.type == "cpu"  # the pools' bounds, checked on the host each step (tests run on CPU)
        self.timings = {"prepare_s": 0.0, "submit_s": 0.0, "wait_s": 0.0}  # host wall seconds, cumulative
        # MoE models: each computed token's experts, by KV slot (tidal.engine.native.moe.record)
        sink = getattr(model, "routing_sink", None)
        self.routing = RoutingRecorder(sink, block_size, device) if sink is not None else None

    # ---- KV cache -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Device bytes of one KV block over the full layers (all attention layers without a window pool), K and V."""
        return 2 * self.num_layers * self._half_block_bytes()

    def _half_block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V) cache."""
        b, h, d = self.kv_shape_tail
        return b * h * d * self.kv_dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_layers + self.window_kv_layers)

    def pool_bytes(self, num_blocks: int, window_blocks: int) -> int:
        """Device bytes of a cache of ``num_blocks`` full-layer and ``window_blocks`` window-layer
        blocks (scratch blocks and, at a fixed address, the driver's mapping granularity counted)."""
        half = self._half_block_bytes()
        nbytes = 2 * self.num_layers * self._region_round(num_blocks + 1) * half
        if self.window is not None:
            nbytes += 2 * self.num_window_layers * self._region_round(window_blocks + 1) * half
        return nbytes

    def _region_round(self, blocks: int) -> int:
        """``blocks`` rounded up to what one layer's region maps (whole granules at a fixed address)."""
        if not fixed_memory.supported(self.device):
            return blocks
        half, gran = self._half_block_bytes(), self._regions().granularity
        return -(-blocks * half // gran) * gran // half

    def blocks_for_bytes(self, nbytes: int, seq_len: int | None, max_num_batched_tokens: int) -> tuple[int, int]:
        """The most (full-layer, window-layer) blocks a cache of at most ``nbytes`` holds, the window
        pool sized by :func:`tidal.engine.sizing.window_pool_blocks` for sequences of ``seq_len``
        tokens; (0, 0) if not even one block."""
        return sizing.split_kv_pools(
            lambda n, w: self.pool_bytes(n, w), nbytes, block_size=self.block_size, window=self.window,
            seq_len=seq_len, max_num_batched_tokens=max_num_batched_tokens,
            max_blocks=self._regions().region_bytes // self._half_block_bytes() - 1 if fixed_memory.supported(self.device) else None)

    def _regions(self) -> fixed_memory.FixedAddressRegions:
        if self._kv_regions is None:
            regions = 2 * self.num_layers
            self._kv_regions = fixed_memory.FixedAddressRegions(
                regions, fixed_memory.device_total_bytes(self.device) // regions, self.device)
        return self._kv_regions

    def _window_regions_of(self) -> fixed_memory.FixedAddressRegions:
        if self._window_regions is None:
            regions = 2 * self.num_window_layers
            self._window_regions = fixed_memory.FixedAddressRegions(
                regions, fixed_memory.device_total_bytes(self.device) // regions, self.device)
        return self._window_regions

    def _allocate_layers(self, num_layers: int, num_blocks: int, regions) -> list[torch.Tensor]:
        shape = (num_blocks + 1, *self.kv_shape_tail)
        if regions is not None:
            raws = regions().map((num_blocks + 1) * self._half_block_bytes())
            return [raw.view(self.kv_dtype).view(shape).zero_() for raw in raws]
        whole = torch.zeros((2 * num_layers, *shape), dtype=self.kv_dtype, device=self.device)
        return list(whole.unbind(0))

    def allocate_kv_cache(self, num_blocks: int, window_blocks: int = 0) -> int:
        """Allocate a zeroed cache of ``num_blocks`` (+ the scratch block) for the full layers and,
        with a window pool, ``window_blocks`` (+ its scratch block) for the window layers. Returns
        its bytes; raises :class:`torch.OutOfMemoryError` when the device cannot hold it."""
        assert not self.kv_layers
        fixed = fixed_memory.supported(self.device)
        self.kv_layers = self._allocate_layers(self.num_layers, num_blocks, self._regions if fixed else None)
        self.num_blocks = num_blocks
        if self.window is not None:
            if window_blocks < 1:
                raise ValueError("a model with sliding-window layers needs window_blocks >= 1")
            self.window_kv_layers = self._allocate_layers(self.num_window_layers, window_blocks,
                                                          self._window_regions_of if fixed else None)
            self.num_window_blocks = window_blocks
        if self.routing is not None:
            self.routing.resize((num_blocks + 1) * self.block_size)
        for i, attn in enumerate(self.full_attns):
            attn.k_cache, attn.v_cache = self.kv_layers[2 * i], self.kv_layers[2 * i + 1]
        for i, attn in enumerate(self.window_attns):
            attn.k_cache, attn.v_cache = self.window_kv_layers[2 * i], self.window_kv_layers[2 * i + 1]
        return self.kv_bytes

    def free_kv_cache(self) -> int:
        """Release the KV cache's memory. At fixed addresses the decode graphs stay (they are valid
        again once the cache is re-allocated, at any block count); otherwise they are dropped with it
        and the allocator's cache is emptied. Returns device bytes released."""
        freed = self.graphs.free() if self.graphs is not None and self._kv_regions is None else 0
        freed += self.kv_bytes
        for attn in self.model.layer_attentions():
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.kv_layers, self.window_kv_layers = [], []
        self.num_blocks = self.num_window_blocks = 0
        if self._kv_regions is not None:
            self._kv_regions.unmap()  # no tensor over the regions is left
            if self._window_regions is not None:
                self._window_regions.unmap()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def drop_graphs(self) -> int:
        """Drop the decode graphs (the weights they point to are about to move). Returns their bytes;
        the caller empties the allocator cache once the weights are gone too."""
        return self.graphs.free() if self.graphs is not None else 0

    # ---- inputs ---------------------------------------------------------------------------------
    def _tensor(self, data, dtype) -> torch.Tensor:
        if not isinstance(data, np.ndarray):
            data = np.asarray(data)
        t = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _prefill_inputs(self, batch: Batch, table: SequenceTable):
        bs = self.block_size
        rows, num_new, start = batch.rows, batch.num_new, batch.start
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        T = int(cu[-1])
        row_T = np.repeat(rows, num_new)
        pos_T = np.arange(T, dtype=np.int64) + np.repeat(start - cu[:-1], num_new)
        win = self.window is not None
        flat = np.empty((4 if win else 3, T), dtype=np.int64)  # ids, positions, slots (full, window): one copy
        flat[0] = table.tokens[row_T, pos_T]
        flat[1] = pos_T
        flat[2] = table.block_table[row_T, pos_T // bs].astype(np.int64) * bs + pos_T % bs
        if win:
            flat[3] = table.window_table[row_T, pos_T // bs].astype(np.int64) * bs + pos_T % bs
        ctxs = start + num_new
        width = int(table.num_blocks[rows].max())
        bt = table.block_table[rows, :width]
        if self._check:
            self._check_pools(flat[2], bt, flat[3] if win else None, table.window_table[rows, :width] if win else None,
                              (ctxs - num_new) if win else None, rows, table)
        flat_dev = self._tensor(flat, torch.int64)
        meta = AttnMetadata(
            is_prefill=True,
            slot_mapping_T=flat_dev[2],
            block_tables_BN=self._tensor(bt, torch.int32),
            context_lens_B=self._tensor(ctxs, torch.int32),
            cu_seqlens_q_B1=self._tensor(cu, torch.int32),
            query_lens=num_new.tolist(),
            context_lens=ctxs.tolist(),
            max_query_len=int(num_new.max()),
            max_context_len=int(ctxs.max()),
        )
        if win:
            meta.window = dataclasses.replace(meta, slot_mapping_T=flat_dev[3],
                                              block_tables_BN=self._tensor(table.window_table[rows, :width], torch.int32))
        if self.states is not None:
            slots = self.states.slots(rows)
            meta.state_slots, meta.state_slots_B = slots.tolist(), self._tensor(slots, torch.int64)
        sample_rows = (cu[1:] - 1)[batch.sampling]
        extra = self._multimodal_inputs(batch, table, start, flat_dev[0]) if self.model.multimodal else {}
        draws = (rows[batch.sampling], ctxs[batch.sampling])  # each sampled token's slot and index
        return flat_dev[0], flat_dev[1], meta, sample_rows, extra, draws, flat[2]

    def _multimodal_inputs(self, batch: Batch, table: SequenceTable, start: np.ndarray, ids_T: torch.Tensor) -> dict:
        """For a prefill batch holding image prompts: the embeddings with the image features in the
        placeholders' rows, and every token's M-RoPE ``[cos | sin]`` row. {} for text-only batches
        (M-RoPE with three equal ids is the 1-D table). A prompt's features are computed by the first
        chunk that needs them and kept on its :class:`MultimodalPrompt`."""
        seqs = [table.seqs[s] for s in batch.rows.tolist()]
        if all(seq.mm is None for seq in seqs):
            return {}
        pos3, feats, dst, offset = [], [], [], 0
        for seq, s, n in zip(seqs, start.tolist(), batch.num_new.tolist()):
            mm = seq.mm
            if mm is None:
                pos3.append(np.broadcast_to(np.arange(s, s + n, dtype=np.int64), (3, n)))
            else:
                pos3.append(mm.positions_3(s, n))
                sel = np.nonzero(mm.feature_rows_L[s : s + n] >= 0)[0]
                if len(sel):
                    if mm.features is None:
                        mm.features = self.model.image_features(mm)
                    feats.append(mm.features[self._tensor(mm.feature_rows_L[s + sel], torch.int64)])
                    dst.append(sel + offset)
            offset += n
        cos_sin_TD = self.model.rope_rows(self._tensor(np.ascontiguousarray(np.concatenate(pos3, axis=1)), torch.int64))
        embeds_TH = None
        if feats:
            embeds_TH = self.model.model.embed_tokens(ids_T)
            embeds_TH[self._tensor(np.concatenate(dst), torch.int64)] = torch.cat(feats).to(embeds_TH.dtype)
        return {"embeds_TH": embeds_TH, "cos_sin_TD": cos_sin_TD}

    def _decode_inputs(self, batch: Batch, table: SequenceTable) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``[4, B]`` int64 rows (input token, position, cache slot, context length; with a window
        pool a fifth: the slot in the window layers' pool), the block tables ``[B, width]`` and the
        window layers' (None without). A row scheduled ahead (``src_rows >= 0``) runs one token past its
        sequence's current length (its input token is not known yet: 0 here, fed on the device)."""
        bs, rows = self.block_size, batch.rows
        ahead = batch.src_rows >= 0 if batch.src_rows is not None else np.zeros(len(rows), dtype=bool)
        inputs = np.empty((5 if self.window is not None else 4, len(rows)), dtype=np.int64)
        ctx = table.num_tokens[rows] + ahead
        last = ctx - 1
        inputs[0] = 0
        known = ~ahead  # a row ahead reads past its tokens (maybe past the table's width): not read
        inputs[0, known] = table.tokens[rows[known], last[known]]
        inputs[1] = last + table.rope_delta[rows]
        inputs[2] = table.block_table[rows, last // bs].astype(np.int64) * bs + last % bs
        inputs[3] = ctx
        width = int(table.num_blocks[rows].max())
        return inputs, table.block_table[rows, :width], self._window_rows(inputs, table, rows, last, width)

    def _window_rows(self, inputs: np.ndarray, table: SequenceTable, rows_T: np.ndarray, pos_T: np.ndarray,
                     width: int) -> np.ndarray | None:
        """With a window pool: fill ``inputs[4]`` (each row's slot in it) and return its block tables."""
        if self.window is None:
            return None
        bs = self.block_size
        inputs[4] = table.window_table[rows_T, pos_T // bs].astype(np.int64) * bs + pos_T % bs
        return table.window_table[rows_T, :width]

    def _check_pools(self, slots_T, bt, wslots_T, wbt, q0_B, rows, table) -> None:
        """An index that leaves its pool fails here (CPU): every slot and held block id of the step
        inside its pool, and a window layer's block table read only from each row's held columns
        (``q0_B``: each row's first query position)."""
        bs = self.block_size
        _within("full-attention KV slot", slots_T, (self.num_blocks + 1) * bs)
        _within("full-attention block id", bt, self.num_blocks + 1)
        if wslots_T is None:
            return
        _within("sliding-window KV slot", wslots_T, (self.num_window_blocks + 1) * bs)
        _within("sliding-window block id", wbt, self.num_window_blocks + 1)
        first = np.maximum(0, q0_B - self.window + 1) // bs
        lo = table.win_lo[rows]
        if (first < lo).any():
            i = int(np.argmax(first < lo))
            raise IndexError(f"sequence in slot {rows[i]}: its step reads window column {first[i]}, but columns below "
                             f"{lo[i]} were given back to the sliding-window pool")

    def _verify_inputs(self, batch: Batch, table: SequenceTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A verify batch as decode rows: row i of the batch becomes ``draft_lens[i] + 1`` rows at
        positions ``N - 1 .. N - 1 + k`` (``N``: its tokens) feeding its last token then its drafts,
        each attending to the context up to itself (the drafted positions' K/V are written by the
        same step before any attention reads it, so this is causal attention over the drafts).
        Returns the ``[4, T]`` inputs and ``[T, width]`` block tables as :meth:`_decode_inputs`, the
        draft each row verifies (``VOID`` on a sequence's last row) and each row's sequence index."""
        bs, rows, k = self.block_size, batch.rows, batch.draft_lens
        reps = k + 1
        T = int(reps.sum())
        group_T = np.repeat(np.arange(len(rows)), reps)
        slot_T = rows[group_T]
        col_T = np.arange(T) - np.repeat(np.cumsum(reps) - reps, reps)
        pos_T = table.num_tokens[slot_T] - 1 + col_T
        inputs = np.empty((5 if self.window is not None else 4, T), dtype=np.int64)
        inputs[0] = table.tokens[slot_T, pos_T - col_T]
        inputs[0, col_T > 0] = batch.drafts
        inputs[1] = pos_T + table.rope_delta[slot_T]
        inputs[2] = table.block_table[slot_T, pos_T // bs].astype(np.int64) * bs + pos_T % bs
        inputs[3] = pos_T + 1
        draft_T = np.full(T, VOID, dtype=np.int64)
        nxt = col_T[1:] > 0
        draft_T[:-1][nxt] = inputs[0, 1:][nxt]
        width = int(table.num_blocks[rows].max())
        return inputs, table.block_table[slot_T, :width], self._window_rows(inputs, table, slot_T, pos_T, width), draft_T, group_T

    # ---- step -----------------------------------------------------------------------------------
    def run(self, batch: Batch, table: SequenceTable, sampling: SamplingFilter) -> tuple[np.ndarray, np.ndarray]:
        """Run ``batch``; returns (token ids, logprobs) of its sampling rows, identical on every TP rank."""
        return self.wait(self.launch(batch, table, sampling))

    @torch.inference_mode()
    def launch(self, batch: Batch, table: SequenceTable, sampling: SamplingFilter,
               prev: StepHandle | None = None) -> StepHandle:
        """Enqueue ``batch`` (model, sampling, copy of the results to the host) without waiting.
        A batch scheduled ahead (``batch.src_rows``) takes its input tokens from ``prev``'s samples
        on the device."""
        with exact_numerics(self.exact):
            return self._launch(batch, table, sampling, prev)

    def _launch(self, batch: Batch, table: SequenceTable, sampling: SamplingState, prev: StepHandle | None) -> StepHandle:
        t0 = time.perf_counter()
        samples = None  # [2, n] (token ids, logprobs) when a graph sampled in place
        verify = batch.draft_lens is not None  # a decode step verifying drafts
        routing = None  # the step's routing on its way to the host (MoE models)
        if self.states is not None:
            self.states.apply()  # the scheduler's state copies, before the step that reads them
        if batch.is_prefill:
            ids, pos, meta, rows, extra, (slots, index), slots_T = self._prefill_inputs(batch, table)
            u = self._uniforms(table, slots, index, sampling)
            t1 = time.perf_counter()
            buf = self.routing.eager_buffer(ids.shape[0]) if self.routing is not None else None
            hidden = self.model(ids, pos, meta, **extra)
            if buf is not None:
                routing = self.routing.copy_out(buf, slots_T, decode=False)
            n = len(rows)
            logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)]) if n else None
        else:
            if verify:
                inputs, bt, wbt, draft_T, group_T = self._verify_inputs(batch, table)
            else:
                inputs, bt, wbt = self._decode_inputs(batch, table)
                group_T = None
            n = inputs.shape[1]
            if self._check:
                self._check_pools(inputs[2], bt, inputs[4] if wbt is not None else None, wbt, inputs[3] - 1,
                                  batch.rows if group_T is None else batch.rows[group_T], table)
            # row t samples the token at index inputs[3, t] (its context length) of its sequence
            u = self._uniforms(table, batch.rows if group_T is None else batch.rows[group_T], inputs[3], sampling)
            ids_dev = self._ahead_ids(batch.src_rows, prev, inputs[0]) if batch.src_rows is not None else None
            t1 = time.perf_counter()
            if self.graphs is not None and self.graphs.fits(n):
                # the logits and the draw are in the graph too (not for a verify step: it accepts)
                in_graph = fused_applies(self.device, sampling) and not verify
                res = self.graphs.run(inputs, bt, self.num_blocks, ids_dev,
                                      temperature=sampling.temperature if in_graph else None, uniforms=u,
                                      window_bt=wbt, window_scratch=self.num_window_blocks)
                if in_graph:
                    samples = res.contiguous()
                else:
                    hidden = res
                if self.routing is not None:
                    routing = self.routing.copy_out(self.graphs.bufs["routing"], inputs[2], decode=True)
            else:
                inputs_dev = self._tensor(inputs, torch.int64)
                meta = AttnMetadata(
                    is_prefill=False,
                    slot_mapping_T=inputs_dev[2],
                    block_tables_BN=self._tensor(bt, torch.int32),
                    context_lens_B=inputs_dev[3],
                    max_context_len=int(inputs[3].max()),
                )
                if wbt is not None:
                    meta.window = dataclasses.replace(meta, slot_mapping_T=inputs_dev[4],
                                                      block_tables_BN=self._tensor(wbt, torch.int32))
                if self.states is not None:
                    meta.state_slots_B = self._tensor(self.states.slots(batch.rows), torch.int64)
                buf = self.routing.eager_buffer(n) if self.routing is not None else None
                hidden = self.model(ids_dev if ids_dev is not None else inputs_dev[0], inputs_dev[1], meta)
                if buf is not None:
                    routing = self.routing.copy_out(buf, inputs[2], decode=True)
            if samples is None:
                logits = self.model.compute_logits(hidden)
        self.timings["prepare_s"] += t1 - t0
        if samples is not None:
            handle = self._publish(samples)
        elif verify:
            handle = self._verify(logits, draft_T, group_T, u, sampling)
        else:
            handle = self._sample(logits, n, u, sampling)
        handle.routing = routing
        self.timings["submit_s"] += time.perf_counter() - t1
        return handle

    def _ahead_ids(self, src_rows: np.ndarray, prev: StepHandle, host_ids: np.ndarray) -> torch.Tensor:
        """The input tokens of a batch scheduled ahead, on the device: ``prev``'s samples at
        ``src_rows``, and ``host_ids`` where ``src_rows`` is -1 (tokens known on the host). A sample
        of NO_TOKEN (non-finite logits: :class:`NonFiniteLogits` when ``prev`` is waited for) enters
        as token 0, never as an index outside the embedding."""
        out, k = prev.out[0], len(src_rows)
        if src_rows.max() < 0:
            return self._tensor(host_ids, torch.int64)
        if src_rows.min() >= 0:
            same = k <= out.shape[0] and np.array_equal(src_rows, np.arange(k))  # a prefix of the samples
            return (out[:k] if same else out[self._tensor(src_rows, torch.int64)]).long().clamp_min(0)
        idx = self._tensor(np.stack([np.maximum(src_rows, 0), src_rows >= 0, host_ids]), torch.int64)
        return torch.where(idx[1].bool(), out[idx[0]].long().clamp_min(0), idx[2])

    def _uniforms(self, table: SequenceTable, slots: np.ndarray, index: np.ndarray, sampling: SamplingFilter
                  ) -> np.ndarray | None:
        """The keyed uniform of each sampled token (``slots``: its sequence's slot, ``index``: its
        index in the sequence); None where nothing is drawn (greedy, or a TP rank but the first)."""
        if sampling.temperature == 0 or not self.tp.is_first:
            return None
        return keyed_uniforms(table.rng_seed[slots], table.rng_key[slots], index)

    def _sample(self, logits_BV, n: int, u: np.ndarray | None, sampling: SamplingFilter) -> StepHandle:
        out = torch.empty(2, n, dtype=torch.float64, device=self.device)
        if n == 0:
            return StepHandle(out, out.cpu(), None)
        if self.tp.is_first:
            u_B = None if u is None else self._tensor(u, torch.float32)
            token_B, logp_B = sample(logits_BV, sampling.temperature, sampling.top_k, sampling.top_p, u_B, min_p=sampling.min_p,
                                   fused=not self.exact)
            out[0], out[1] = token_B, logp_B
        return self._publish(out)

    def _verify(self, logits_TV, draft_T: np.ndarray, group_T: np.ndarray, u: np.ndarray | None,
                sampling: SamplingFilter) -> StepHandle:
        """Accept the drafts on TP rank 0 (:func:`~tidal.engine.native.speculative.acceptance.accept`)
        and share the emitted tokens: ``[2, T]`` (token or ``VOID``, logprob) per computed position."""
        out = torch.empty(2, len(draft_T), dtype=torch.float64, device=self.device)
        if self.tp.is_first:
            token_T, logp_T = accept(logits_TV, self._tensor(draft_T, torch.int64), self._tensor(group_T, torch.int64),
                                     None if u is None else self._tensor(u, torch.float32),
                                     sampling=sampling)
            out[0], out[1] = token_T, logp_T
        return self._publish(out)

    def _publish(self, out: torch.Tensor) -> StepHandle:
        """Share TP rank 0's samples ``out`` ``[2, n]`` and start their copy to the host."""
        self.tp.broadcast_from_first(out)
        if self.device.type != "cuda":
            return StepHandle(out, out.cpu(), None)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return StepHandle(out, host, done)

    def wait(self, handle: StepHandle) -> tuple[np.ndarray, np.ndarray]:
        """Block until ``handle``'s samples are on the host; returns (token ids int64, logprobs float64)."""
        t0 = time.perf_counter()
        if handle.done is not None:
            handle.done.synchronize()
        self.timings["wait_s"] += time.perf_counter() - t0
        if handle.routing is not None:
            self.routing.commit(handle.routing)
            handle.routing = None  # written once (a handle may be waited for twice)
        host = handle.host.numpy()
        tokens, logprobs = host[0].astype(np.int64), host[1]
        if (tokens == NO_TOKEN).any():  # (a speculative step's VOID, -1, is a rejected position, not this)
            raise NonFiniteLogits(np.flatnonzero(tokens == NO_TOKEN))
        return tokens, logprobs


class NonFiniteLogits(RuntimeError):
    """A step's logits held no token of positive probability (NaN or infinite logits): the sampler
    returns :data:`~tidal.engine.sampler.NO_TOKEN` for such a row instead of reading outside it."""

    def __init__(self, rows: np.ndarray):
        super().__init__(f"the model's logits are not finite (NaN or inf) in {len(rows)} row(s) of this engine step "
                         f"(rows {rows[:8].tolist()}): no token can be sampled. The weights or a kernel produced them: "
                         "check the checkpoint for NaN/inf (tidal check), or run the step with engine.kernel_backend=torch "
                         "to tell a kernel fault from the weights")


def _within(what: str, index: np.ndarray, size: int) -> None:
    """IndexError unless every entry of ``index`` lies in ``[0, size)``."""
    if index.size and (int(index.min()) < 0 or int(index.max()) >= size):
        bad = index[(index < 0) | (index >= size)].reshape(-1)[0]
        raise IndexError(f"{what} {int(bad)} outside its pool of {size}")


@dataclasses.dataclass
class StepHandle:
    """A launched step: its samples on the device (``out``: row 0 tokens, row 1 logprobs), the
    host copy being made, and the event that marks it done (None on CPU: already done)."""

    out: torch.Tensor
    host: torch.Tensor
    done: "torch.cuda.Event | None"
    routing: tuple | None = None  # MoE: the step's routing copy (RoutingRecorder.copy_out), until waited for
