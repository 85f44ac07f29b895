"""Reference kernels in plain PyTorch: run on any device, define the semantics the Triton ones match.

Numerics follow the Hugging Face Qwen2/Llama modules (RMSNorm in fp32, cast back before the weight;
rotate-half RoPE in the activation dtype; softmax in fp32), so fp32 outputs match HF to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.engine.native.attention import AttnMetadata
from tidal.engine.native.kernels.registry import KERNELS


def _flat_slots(block_table: torch.Tensor, length: int, block_size: int, first: int = 0) -> torch.Tensor:
    """Cache slots of token positions ``first..length-1`` of one sequence (int64); the block table's
    columns before ``first``'s are not read (a window layer's pool gave them back)."""
    c0, nblocks = first // block_size, (length + block_size - 1) // block_size
    base = block_table[c0:nblocks].long()[:, None] * block_size
    return (base + torch.arange(block_size, device=block_table.device)).reshape(-1)[first - c0 * block_size : length - c0 * block_size]


@KERNELS.register("torch")
class TorchOps:
    def rms_norm(self, x_TH, weight_H, eps: float, residual_TH=None):
        """``y = weight * normalize(x + residual)``; returns (y, x + residual) (residual None: (y, x))."""
        if residual_TH is not None:
            x_TH = residual_TH + x_TH
        residual_TH = x_TH
        x32 = x_TH.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight_H * y.to(x_TH.dtype), residual_TH

    def silu_mul(self, x_T2I):
        """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim."""
        gate, up = x_T2I.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_store(self, q_THD, k_TKD, v_TKD, positions_T, cos_sin_PD, k_cache, v_cache, slot_mapping_T):
        """Rotate q and k (rotate-half RoPE; ``cos_sin_PD = [cos | sin]`` per position), write the rotated
        k and v into their cache slots, return the rotated q."""
        half = q_THD.shape[-1] // 2
        cs = cos_sin_PD[positions_T]
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rot(x):
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        q_THD, k_TKD = rot(q_THD), rot(k_TKD)
        if k_cache.numel():
            flat_k = k_cache.view(-1, *k_cache.shape[2:])
            flat_v = v_cache.view(-1, *v_cache.shape[2:])
            flat_k.index_copy_(0, slot_mapping_T, k_TKD.to(k_cache.dtype))
            flat_v.index_copy_(0, slot_mapping_T, v_TKD.to(v_cache.dtype))
        return q_THD

    def prefill_attention(self, q_THD, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
        """Causal attention of each sequence's new tokens over its cached context (with ``window``:
        a query at ``p`` over the keys ``p - window < j <= p`` only)."""
        out = torch.empty_like(q_THD)
        block_size = k_cache.shape[1]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        start = 0
        for i, (qlen, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            first = 0 if window is None else max(0, ctx - qlen - window + 1)  # the first query's first key
            slots = _flat_slots(meta.block_tables_BN[i], ctx, block_size, first)
            q = q_THD[start : start + qlen].transpose(0, 1)  # [H, L, D]
            k = flat_k[slots].transpose(0, 1)  # [Hkv, ctx - first, D]
            v = flat_v[slots].transpose(0, 1)
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            kpos = torch.arange(first, ctx, device=q.device)[None, :]
            mask = qpos[:, None] >= kpos
            if window is not None:
                mask &= kpos > qpos[:, None] - window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start : start + qlen] = o.transpose(0, 1)
            start += qlen
        return out

    def decode_attention(self, q_BHD, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
        """One query per sequence over its ``context_lens_B`` cached tokens (batched gather); with
        ``window``, over the last ``window`` of them (the query is at position ``context_len - 1``):
        only the block-table columns from each row's window on are read (a window layer's pool gave
        the earlier ones back). Keys past a row's context (its padding columns) are zeroed before
        use: a masked key must weigh nothing even if its block holds non-finite values."""
        B, H, D = q_BHD.shape
        block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
        ctx_B = meta.context_lens_B.long()
        width = meta.block_tables_BN.shape[1]
        if window is None:
            ncols = min(width, (meta.max_context_len + block_size - 1) // block_size)
            col0_B = torch.zeros_like(ctx_B)
        else:
            ncols = min(width, (window - 1) // block_size + 2)
            col0_B = (ctx_B - window).clamp(min=0) // block_size
        cols_BC = (col0_B[:, None] + torch.arange(ncols, device=ctx_B.device)).clamp(max=width - 1)
        bt = meta.block_tables_BN.long().gather(1, cols_BC)
        kpos = ((col0_B[:, None] + torch.arange(ncols, device=ctx_B.device))[:, :, None] * block_size
                + torch.arange(block_size, device=ctx_B.device)).reshape(B, -1)  # [B, n]
        slots = (bt[:, :, None] * block_size + torch.arange(block_size, device=bt.device)).reshape(B, -1)
        valid = kpos < ctx_B[:, None]
        if window is not None:
            valid &= kpos >= ctx_B[:, None] - window
        keep = valid[:, :, None, None]
        k = torch.where(keep, k_cache.view(-1, Hkv, D)[slots], 0)  # [B, n, Hkv, D]
        v = torch.where(keep, v_cache.view(-1, Hkv, D)[slots], 0)
        q = q_BHD.view(B, Hkv, H // Hkv, D)
        s = torch.einsum("bhgd,bnhd->bhgn", q.float(), k.float()) * scale
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = s.softmax(-1)
        o = torch.einsum("bhgn,bnhd->bhgd", p, v.float())
        return o.reshape(B, H, D).to(q_BHD.dtype)
