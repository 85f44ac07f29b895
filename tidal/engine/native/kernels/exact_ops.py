"""Exact mode's kernel backend (``numerics.exact``, docs/exact.md): the torch reference ops with
attention through :func:`tidal.exact.attention`, the batch-invariant attention the trainer's packed
forward runs too. The runner enters :func:`tidal.exact.exact_numerics` around each step, so the
matmuls and activations inside (the layers' ``F.linear``, ``silu_mul``'s ``F.silu``) take their
invariant forms. No CUDA graphs (``graph_safe`` is False): a step is eager."""

from __future__ import annotations

import torch

from tidal import exact
from tidal.engine.native.attention import AttnMetadata
from tidal.engine.native.kernels.registry import KERNELS
from tidal.engine.native.kernels.torch_ops import TorchOps, _flat_slots


@KERNELS.register("exact")
class ExactOps(TorchOps):
    exact = True

    def prefill_attention(self, q_THD, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
        """Each sequence's new tokens (at positions ``ctx - qlen .. ctx - 1``) over its cached keys."""
        out = torch.empty_like(q_THD)
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        start = 0
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            slots = _flat_slots(meta.block_tables_BN[i], ctx, block_size)
            qpos = torch.arange(ctx - qlen, ctx, device=q_THD.device)[None]
            klen = torch.tensor([ctx], device=q_THD.device)
            out[start : start + qlen] = exact.attention(q_THD[None, start : start + qlen], flat_k[slots][None], flat_v[slots][None],
                                                        qpos, klen, scale, window)[0]
            start += qlen
        return out

    def decode_attention(self, q_BHD, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
        """One query per sequence, at position ``context_len - 1``, over its cached keys."""
        B, H, D = q_BHD.shape
        block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
        n = meta.max_context_len
        nblocks = (n + block_size - 1) // block_size
        bt = meta.block_tables_BN[:, :nblocks].long()
        slots = (bt[:, :, None] * block_size + torch.arange(block_size, device=bt.device)).reshape(B, -1)[:, :n]
        ctx_B = meta.context_lens_B.long()
        k = k_cache.view(-1, Hkv, D)[slots]  # [B, n, Hkv, D]
        v = v_cache.view(-1, Hkv, D)[slots]
        return exact.attention(q_BHD[:, None], k, v, (ctx_B - 1)[:, None], ctx_B, scale, window)[:, 0]
