"""Runs one scheduled step on the device: builds the flat inputs and attention metadata, runs the model
(eagerly, or by replaying a captured decode graph), samples on TP rank 0 and shares the result.

Owns the KV-cache tensor ``[layers, 2, num_blocks + 1, block_size, H_kv, D]``; the extra last block
is a scratch block that padded rows of a CUDA-graph batch write into. On CUDA with the driver's
virtual memory management the cache lives at one fixed address (:mod:`fixed_memory`): freeing it
gives its memory back to the driver, allocating it again maps new memory at the same address, and
the decode graphs, which point into it, are kept. Knows nothing about requests or the scheduling policy.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch

from tidal.engine.native import fixed_memory
from tidal.engine.native.attention import AttnMetadata
from tidal.engine.native.cuda_graphs import DecodeGraphs
from tidal.engine.native.models import DecoderLM, head_dim_of
from tidal.engine.native.parallel import TPGroup
from tidal.engine.native.scheduler import Batch
from tidal.engine.sampler import fused_applies, sample


@dataclasses.dataclass
class SamplingState:
    """The processed distribution of one generate call, and its random stream (TP rank 0 only)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None

    def fused_on(self, device: torch.device) -> bool:
        """Whether decode CUDA graphs sample in the graph (the fused sampler's distributions)."""
        return fused_applies(device, self.top_k, self.top_p)


class ModelRunner:
    def __init__(self, model: DecoderLM, tp: TPGroup, *, block_size: int, device: torch.device, use_graphs: bool,
                 max_num_seqs: int):
        self.model = model
        self.tp = tp
        self.block_size = block_size
        self.device = device
        cfg = model.config
        attn = model.layer_attentions()[0]
        self.kv_shape_tail = (block_size, attn.num_kv_heads, head_dim_of(cfg))
        self.num_layers = cfg.num_hidden_layers
        self.kv_dtype = model.cos_sin_PD.dtype
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self._kv_memory: fixed_memory.FixedAddressMemory | None = None  # the cache's address range, kept
        self.max_blocks_per_seq = (model.max_positions + block_size - 1) // block_size
        self.graphs = DecodeGraphs(model, max_num_seqs, self.max_blocks_per_seq, device) if use_graphs else None
        self._pin = device.type == "cuda"
        self.timings = {"prepare_s": 0.0, "submit_s": 0.0, "wait_s": 0.0}  # host wall seconds, cumulative

    # ---- KV cache -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        """Device bytes of one KV block over all layers (K and V)."""
        b, h, d = self.kv_shape_tail
        return self.num_layers * 2 * b * h * d * self.kv_dtype.itemsize

    @property
    def fixed_kv_blocks(self) -> int:
        """Blocks of the fixed-address KV range from an earlier allocation (0: none); allocating that
        many again keeps the decode graphs."""
        return self._kv_memory.nbytes // self.block_bytes() - 1 if self._kv_memory is not None else 0  # - scratch

    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Allocate a zeroed cache of ``num_blocks`` (+ the scratch block). Returns its bytes."""
        assert self.kv_cache is None
        shape = (self.num_layers, 2, num_blocks + 1, *self.kv_shape_tail)
        nbytes = math.prod(shape) * self.kv_dtype.itemsize
        if self._kv_memory is not None and num_blocks != self.fixed_kv_blocks:
            self._release_kv_range()
        if self._kv_memory is None and fixed_memory.supported(self.device):
            self._kv_memory = fixed_memory.FixedAddressMemory(nbytes, self.device)
        if self._kv_memory is not None:
            try:
                raw = self._kv_memory.map()
            except torch.OutOfMemoryError:  # the trainer's cached blocks hold the memory: hand them back
                torch.cuda.empty_cache()
                raw = self._kv_memory.map()
            self.kv_cache = raw.view(self.kv_dtype).view(shape).zero_()
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.num_blocks = num_blocks
        for i, attn in enumerate(self.model.layer_attentions()):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        return nbytes

    def free_kv_cache(self) -> int:
        """Release the KV cache's memory. At a fixed address the decode graphs stay (they are valid
        again once the cache is re-allocated at the same size); otherwise they are dropped with it
        and the allocator's cache is emptied. Returns device bytes released."""
        freed = self.graphs.free() if self.graphs is not None and self._kv_memory is None else 0
        if self.kv_cache is not None:
            freed += self.kv_cache.numel() * self.kv_cache.element_size()
            for attn in self.model.layer_attentions():
                attn.k_cache = attn.v_cache = torch.empty(0)
            self.kv_cache = None
            self.num_blocks = 0
        if self._kv_memory is not None:
            self._kv_memory.unmap()  # no tensor over the range is left
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def drop_graphs(self) -> int:
        """Drop the decode graphs (the weights they point to are about to move). Returns their bytes;
        the caller empties the allocator cache once the weights are gone too."""
        return self.graphs.free() if self.graphs is not None else 0

    def _release_kv_range(self) -> None:
        if self.graphs is not None:
            self.graphs.free()
        self._kv_memory.close()
        self._kv_memory = None

    # ---- inputs ---------------------------------------------------------------------------------
    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self._pin) if not isinstance(data, np.ndarray) else (
            torch.from_numpy(data).pin_memory() if self._pin else torch.from_numpy(data))
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, seqs) -> np.ndarray:
        width = max(len(s.block_table) for s in seqs)
        bt = np.full((len(seqs), width), self.num_blocks, dtype=np.int32)  # pad with the scratch block
        for i, s in enumerate(seqs):
            bt[i, : len(s.block_table)] = s.block_table
        return bt

    def _prefill_inputs(self, batch: Batch):
        bs = self.block_size
        ids, pos, slots, qlens, ctxs = [], [], [], [], []
        for seq in batch.seqs:
            s, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            ids.extend(seq.token_ids[s : s + n])
            pos.extend(range(s, s + n))
            bt = seq.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(s, s + n))
            qlens.append(n)
            ctxs.append(s + n)
        cu = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        meta = AttnMetadata(
            is_prefill=True,
            slot_mapping_T=self._tensor(slots, torch.int64),
            block_tables_BN=self._tensor(self._block_tables(batch.seqs), torch.int32),
            context_lens_B=self._tensor(ctxs, torch.int32),
            cu_seqlens_q_B1=self._tensor(cu, torch.int32),
            query_lens=qlens,
            context_lens=ctxs,
            max_query_len=max(qlens),
            max_context_len=max(ctxs),
        )
        rows = [int(cu[i + 1]) - 1 for i, samples in enumerate(batch.sampling) if samples]
        ids_T = self._tensor(ids, torch.int64)
        extra = self._multimodal_inputs(batch, ids_T) if self.model.multimodal else {}
        return ids_T, self._tensor(pos, torch.int64), meta, rows, extra

    def _multimodal_inputs(self, batch: Batch, ids_T: torch.Tensor) -> dict:
        """For a prefill batch holding image prompts: the embeddings with the image features in the
        placeholders' rows, and every token's M-RoPE ``[cos | sin]`` row. {} for text-only batches
        (M-RoPE with three equal ids is the 1-D table). A prompt's features are computed by the first
        chunk that needs them and kept on its :class:`MultimodalPrompt`."""
        if all(seq.mm is None for seq in batch.seqs):
            return {}
        pos3, feats, dst, offset = [], [], [], 0
        for seq in batch.seqs:
            s, n, mm = seq.num_cached_tokens, seq.num_scheduled_tokens, seq.mm
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

    def _decode_inputs(self, batch: Batch):
        """Per-row input token, position, slot, context length and block table. A batch scheduled
        ahead runs one token past each sequence's current length (its input token is not known yet:
        0 here, fed on the device)."""
        bs = self.block_size
        ahead = int(batch.src_rows is not None)
        ctxs = [len(s) + ahead for s in batch.seqs]
        ids = [0] * len(ctxs) if ahead else [s.token_ids[-1] for s in batch.seqs]
        slots = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(batch.seqs, ctxs)]
        pos = [n - 1 + s.rope_delta for s, n in zip(batch.seqs, ctxs)]
        return ids, pos, slots, ctxs, self._block_tables(batch.seqs)

    # ---- step -----------------------------------------------------------------------------------
    def run(self, batch: Batch, sampling: SamplingState) -> tuple[list[int], list[float]]:
        """Run ``batch``; returns (token ids, logprobs) of its sampling rows, identical on every TP rank."""
        return self.wait(self.launch(batch, sampling))

    @torch.inference_mode()
    def launch(self, batch: Batch, sampling: SamplingState, prev: StepHandle | None = None) -> StepHandle:
        """Enqueue ``batch`` (model, sampling, copy of the results to the host) without waiting.
        A batch scheduled ahead (``batch.src_rows``) takes its input tokens from ``prev``'s samples
        on the device."""
        t0 = time.perf_counter()
        samples = None  # [2, n] (token ids, logprobs) when a graph sampled in place
        if batch.is_prefill:
            ids, pos, meta, rows, extra = self._prefill_inputs(batch)
            t1 = time.perf_counter()
            hidden = self.model(ids, pos, meta, **extra)
            logits = self.model.compute_logits(hidden[self._tensor(rows, torch.int64)]) if rows else None
            n = len(rows)
        else:
            ids, pos, slots, ctxs, bt = self._decode_inputs(batch)
            ids_dev = None
            if batch.src_rows is not None:
                src = prev.out[0]
                if batch.src_rows != list(range(len(batch.src_rows))):
                    src = src[self._tensor(batch.src_rows, torch.int64)]
                ids_dev = src[: len(ids)].long()
            t1 = time.perf_counter()
            n = len(ids)
            if self.graphs is not None and self.graphs.fits(n):
                in_graph = sampling.fused_on(self.device)  # the logits and the draw are in the graph too
                res = self.graphs.run(ids, pos, slots, ctxs, bt, self.num_blocks, ids_dev,
                                      temperature=sampling.temperature if in_graph else None,
                                      generator=sampling.generator, draws=self.tp.is_first)
                if in_graph:
                    samples = res.contiguous()
                else:
                    hidden = res
            else:
                meta = AttnMetadata(
                    is_prefill=False,
                    slot_mapping_T=self._tensor(slots, torch.int64),
                    block_tables_BN=self._tensor(bt, torch.int32),
                    context_lens_B=self._tensor(ctxs, torch.int32),
                    max_context_len=max(ctxs),
                )
                ids_t = ids_dev if ids_dev is not None else self._tensor(ids, torch.int64)
                hidden = self.model(ids_t, self._tensor(pos, torch.int64), meta)
            if samples is None:
                logits = self.model.compute_logits(hidden)
        self.timings["prepare_s"] += t1 - t0
        handle = self._publish(samples) if samples is not None else self._sample(logits, n, sampling)
        self.timings["submit_s"] += time.perf_counter() - t1
        return handle

    def _sample(self, logits_BV, n: int, sampling: SamplingState) -> StepHandle:
        out = torch.empty(2, n, dtype=torch.float64, device=self.device)
        if n == 0:
            return StepHandle(out, out.cpu(), None)
        if self.tp.is_first:
            token_B, logp_B = sample(logits_BV, sampling.temperature, sampling.top_k, sampling.top_p, sampling.generator)
            out[0], out[1] = token_B, logp_B
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

    def wait(self, handle: StepHandle) -> tuple[list[int], list[float]]:
        """Block until ``handle``'s samples are on the host; returns (token ids, logprobs)."""
        t0 = time.perf_counter()
        if handle.done is not None:
            handle.done.synchronize()
        self.timings["wait_s"] += time.perf_counter() - t0
        return handle.host[0].long().tolist(), handle.host[1].tolist()


@dataclasses.dataclass
class StepHandle:
    """A launched step: its samples on the device (``out``: row 0 tokens, row 1 logprobs), the
    host copy being made, and the event that marks it done (None on CPU: already done)."""

    out: torch.Tensor
    host: torch.Tensor
    done: "torch.cuda.Event | None"
