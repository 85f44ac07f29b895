"""Paged attention: the per-step metadata and the layer module that writes K/V into the cache and attends.

The KV cache of one layer is ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, H_kv, D]``;
token ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.
Every step first writes the new tokens' (rotated) K and V into their slots, then attends over the
cache only, so prefill with a cached prefix, chunked prefill and decode are one code path.

A sliding-window layer (``window``, HF's ``sliding_window``) lets a query at position ``p`` attend
to the keys at ``p - window < j <= p`` only (:class:`tidal.families.LayerCache`). Beside full
layers, its cache is a pool of its own whose blocks are given back once they leave the window
(:mod:`~tidal.engine.native.window_blocks`): it writes and reads through the step's ``window``
metadata (its own slot mapping and block tables, :meth:`PagedAttention.meta_of`), and its kernels
read only the blocks inside each query's window.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class AttnMetadata:
    """What attention needs to know about one batched step (B sequences, T new tokens).

    slot_mapping_T: cache slot of each new token (int64).
    block_tables_BN: block ids of each sequence, padded (int32).
    context_lens_B: KV length of each sequence after this step, new tokens included (int32).
    cu_seqlens_q_B1: prefill only: offsets of each sequence's new tokens in the flat batch (int32).
    query_lens / context_lens: the same lengths as Python ints (prefill; avoids device syncs).
    max_query_len / max_context_len: maxima of the above.
    state_slots_B / state_slots: the recurrent-state slot of each sequence (hybrid models: int64 on
    the device; prefill also as Python ints), None for models without recurrent layers.
    window: the same step as the sliding-window layers' pool addresses it (its ``slot_mapping_T``
    and ``block_tables_BN``; every other field the same), None without a window pool.
    """

    is_prefill: bool
    slot_mapping_T: torch.Tensor
    block_tables_BN: torch.Tensor
    context_lens_B: torch.Tensor
    cu_seqlens_q_B1: torch.Tensor | None = None
    query_lens: list[int] | None = None
    context_lens: list[int] | None = None
    max_query_len: int = 1
    max_context_len: int = 1
    state_slots_B: torch.Tensor | None = None
    state_slots: list[int] | None = None
    window: "AttnMetadata | None" = None


class PagedAttention(nn.Module):
    """Writes K/V of the new tokens into this layer's cache slots, then attends over the cache.

    Holds no parameters; ``k_cache``/``v_cache`` are views into the runner's cache tensor
    (empty while the engine sleeps). ``ops`` is the kernel backend (torch or triton). ``scale``:
    the softmax scale (default ``head_dim ** -0.5``); ``window``: a sliding-window layer's window
    (None: full causal attention).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops, *, scale: float | None = None,
                 window: int | None = None):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"sliding window {window}: must be >= 1")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.ops = ops
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def meta_of(self, meta: AttnMetadata) -> AttnMetadata:
        """The step's metadata as this layer's cache addresses it (a window layer's own pool)."""
        return meta.window if self.window is not None and meta.window is not None else meta

    def forward(self, q_THD: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        meta = self.meta_of(meta)
        if meta.is_prefill:
            return self.ops.prefill_attention(q_THD, self.k_cache, self.v_cache, meta, self.scale, window=self.window)
        return self.ops.decode_attention(q_THD, self.k_cache, self.v_cache, meta, self.scale, window=self.window)
