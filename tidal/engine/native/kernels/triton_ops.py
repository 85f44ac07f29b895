"""Triton kernels for the CUDA fast path; same contracts as :class:`TorchOps`.

- ``rms_norm``: residual add + RMSNorm in one pass (one program per token).
- ``silu_mul``: ``silu(gate) * up``.
- ``rope_store``: RoPE on q and k, and the K/V cache write, for all heads of a token in one program.
- ``decode_attention``: paged attention, one program per (sequence, KV head) computing all the
  query heads of that KV head's group (GQA), online softmax over ``BLOCK_N`` cached tokens at a time.
  Reads the context lengths from device memory, so it can be captured in a CUDA graph.
- ``prefill_attention``: paged causal attention of a varlen batch of new tokens over each
  sequence's cache (prefix included), flash-attention style, one program per (query block, seq, head).
- Both attentions take a sliding ``window`` (a constexpr: one compiled variant per window size):
  the key loops start at the window's first key and mask the keys before each query's window. A
  window layer's block table (its own pool: :mod:`~tidal.engine.native.window_blocks`) has the
  columns before a step's first window given back (entries 0, or reused by another sequence):
  decode reads columns from ``(ctx - WINDOW) // PAGE`` on, prefill from the block of the first
  query of each query tile's window (``prefix + mblk * BLOCK_M - WINDOW + 1``), never before the
  step's first window, which the scheduler keeps.

Head dims must be powers of two (64, 128 in the supported families).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.engine.native.attention import AttnMetadata
from tidal.engine.native.kernels.registry import KERNELS


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, r_out_ptr, stride_x, stride_r, stride_y, H, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(y_ptr.dtype.element_ty)
        tl.store(r_out_ptr + t * H + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + t * stride_y + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_x, I, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t * I + offs, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, qo_ptr,
                       stride_q, stride_k, stride_v, HQ, HKV,
                       HQ_P: tl.constexpr, HKV_P: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                       STORE: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * D + offs).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * D + HALF + offs).to(tl.float32)[None, :]
    hq = tl.arange(0, HQ_P)
    mq = (hq < HQ)[:, None]
    src = q_ptr + t * stride_q + hq[:, None] * D + offs[None, :]
    x1 = tl.load(src, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mq, other=0.0).to(tl.float32)
    dst = qo_ptr + t * HQ * D + hq[:, None] * D + offs[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(qo_ptr.dtype.element_ty), mask=mq)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(qo_ptr.dtype.element_ty), mask=mq)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        hk = tl.arange(0, HKV_P)
        mk = (hk < HKV)[:, None]
        src = k_ptr + t * stride_k + hk[:, None] * D + offs[None, :]
        x1 = tl.load(src, mask=mk, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mk, other=0.0).to(tl.float32)
        dst = kc_ptr + slot * HKV * D + hk[:, None] * D + offs[None, :]
        tl.store(dst, (x1 * cos - x2 * sin).to(kc_ptr.dtype.element_ty), mask=mk)
        tl.store(dst + HALF, (x2 * cos + x1 * sin).to(kc_ptr.dtype.element_ty), mask=mk)
        dd = tl.arange(0, D)
        v = tl.load(v_ptr + t * stride_v + hk[:, None] * D + dd[None, :], mask=mk, other=0.0)
        tl.store(vc_ptr + slot * HKV * D + hk[:, None] * D + dd[None, :], v.to(vc_ptr.dtype.element_ty), mask=mk)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, o_ptr, part_ptr, ml_ptr, scale, stride_bt, HKV,
                         GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr):
    # one program per (row, KV head, split of the context): split s attends to the s-th of SPLITS
    # equal BLOCK_N-aligned slices of the row's attended keys (the context, or with WINDOW > 0 its
    # last WINDOW tokens; read on the device: graph-safe); with SPLITS > 1 it writes its
    # unnormalised output and (max, sum-exp) for _decode_combine_kernel
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    per = tl.cdiv(tl.cdiv(ctx - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + sp * per
    hi = tl.minimum(lo + per, ctx)
    g = tl.arange(0, GROUP_P)
    mg = (g < GROUP)[:, None]
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + (b * HKV * GROUP + heads)[:, None] * D + d[None, :], mask=mg, other=0.0)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        mn = n < hi
        page = tl.load(bt_ptr + b * stride_bt + n // PAGE, mask=mn, other=0).to(tl.int64)
        off = (page * PAGE + n % PAGE) * (HKV * D) + kvh * D
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=mn[:, None], other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * scale
        s = tl.where(mn[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=mn[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    rows = b * HKV * GROUP + heads  # flat (row, query head)
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(o_ptr + rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=mg)
    else:  # an empty split (short context) stores m = -inf, l = 0: no weight in the combine
        tl.store(part_ptr + (rows * SPLITS + sp)[:, None] * D + d[None, :], acc, mask=mg)
        tl.store(ml_ptr + (rows * SPLITS + sp) * 2, m_i, mask=g < GROUP)
        tl.store(ml_ptr + (rows * SPLITS + sp) * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def _decode_combine_kernel(part_ptr, ml_ptr, o_ptr, SPLITS: tl.constexpr, D: tl.constexpr):
    # one program per (row, query head): the splits' outputs weighted by their share of the softmax
    r = tl.program_id(0)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    m = tl.load(ml_ptr + (r * SPLITS + sp) * 2)
    l = tl.load(ml_ptr + (r * SPLITS + sp) * 2 + 1)
    w = tl.where(m > float("-inf"), tl.exp(m - tl.max(m, axis=0)), 0.0)
    acc = tl.load(part_ptr + (r * SPLITS + sp)[:, None] * D + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + r * D + d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _paged_prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, ctx_ptr, o_ptr, scale, stride_bt, HQ, HKV,
                          GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr):
    # query row m (position prefix + m) attends to keys j <= prefix + m, and with WINDOW > 0 only to
    # j > prefix + m - WINDOW: the key loop starts at the block's first query's window; a row with
    # no allowed key in a tile yet keeps max -inf (the safe max below keeps its sums at 0, not NaN)
    mblk = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    prefix = ctx - q_len
    m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < q_len
    d = tl.arange(0, D)
    kvh = h // GROUP
    q = tl.load(q_ptr + ((q_start + m) * HQ + h)[:, None] * D + d[None, :], mask=mm[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    end = tl.minimum(ctx, prefix + (mblk + 1) * BLOCK_M)
    begin = 0
    if WINDOW > 0:
        begin = tl.maximum(prefix + mblk * BLOCK_M - WINDOW + 1, 0)
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        mn = n < end
        page = tl.load(bt_ptr + b * stride_bt + n // PAGE, mask=mn, other=0).to(tl.int64)
        off = (page * PAGE + n % PAGE) * (HKV * D) + kvh * D
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=mn[:, None], other=0.0)
        s = _dot(q, tl.trans(k), IEEE) * scale
        allowed = ((prefix + m)[:, None] >= n[None, :]) & mn[None, :]
        if WINDOW > 0:
            allowed = allowed & (n[None, :] > (prefix + m)[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=mn[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + ((q_start + m) * HQ + h)[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mm[:, None])


def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: any number; small, so the tests split
    return torch.cuda.get_device_properties(device).multi_processor_count


@KERNELS.register("triton")
class TritonOps:
    graph_safe = True

    def rms_norm(self, x_TH, weight_H, eps: float, residual_TH=None):
        T, H = x_TH.shape
        y = torch.empty((T, H), dtype=x_TH.dtype, device=x_TH.device)
        r_out = torch.empty_like(y) if residual_TH is not None else x_TH
        r = residual_TH if residual_TH is not None else x_TH
        _rms_norm_kernel[(T,)](x_TH, r, weight_H, y, r_out, x_TH.stride(0), r.stride(0), H, H, eps,
                               HAS_RES=residual_TH is not None, BLOCK=_p2(H), num_warps=4 if H >= 1024 else 2)
        return y, r_out

    def silu_mul(self, x_T2I):
        T, I2 = x_T2I.shape
        I = I2 // 2
        y = torch.empty((T, I), dtype=x_T2I.dtype, device=x_T2I.device)
        block = min(1024, _p2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, block))](x_T2I, y, x_T2I.stride(0), I, BLOCK=block, num_warps=4)
        return y

    def rope_store(self, q_THD, k_TKD, v_TKD, positions_T, cos_sin_PD, k_cache, v_cache, slot_mapping_T):
        T, HQ, D = q_THD.shape
        HKV = k_TKD.shape[1]
        assert q_THD.stride(2) == 1 and q_THD.stride(1) == D and k_TKD.stride(1) == D and v_TKD.stride(1) == D
        q_out = torch.empty((T, HQ, D), dtype=q_THD.dtype, device=q_THD.device)
        store = k_cache.numel() > 0
        kc, vc = (k_cache, v_cache) if store else (q_out, q_out)
        _rope_store_kernel[(T,)](q_THD, k_TKD, v_TKD, positions_T, cos_sin_PD, kc, vc, slot_mapping_T, q_out,
                                 q_THD.stride(0), k_TKD.stride(0), v_TKD.stride(0), HQ, HKV,
                                 HQ_P=_p2(HQ), HKV_P=_p2(HKV), HALF=D // 2, D=D, STORE=store, num_warps=1)
        return q_out

    def decode_attention(self, q_BHD, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None,
                         splits: int | None = None, block_n: int = 64):
        """Paged decode attention (``window``: over each row's last ``window`` cached tokens). The
        attended keys of each row are split over ``splits`` programs per KV head (flash-decoding)
        when rows x KV heads alone leave SMs idle: default, the power of two (at most 8) that brings
        the programs to about two per SM."""
        B, HQ, D = q_BHD.shape
        HKV, page = k_cache.shape[2], k_cache.shape[1]
        group = HQ // HKV
        if splits is None:
            splits = min(8, _p2(triton.cdiv(2 * _num_sms(q_BHD.device), B * HKV)))
        o = torch.empty_like(q_BHD)
        part = ml = o  # unused when splits == 1
        if splits > 1:
            part = torch.empty(B * HQ * splits, D, dtype=torch.float32, device=q_BHD.device)
            ml = torch.empty(B * HQ * splits, 2, dtype=torch.float32, device=q_BHD.device)
        bt = meta.block_tables_BN
        _paged_decode_kernel[(B, HKV, splits)](q_BHD.contiguous(), k_cache, v_cache, bt, meta.context_lens_B, o, part, ml,
                                               scale, bt.stride(0), HKV, GROUP=group, GROUP_P=max(16, _p2(group)), D=D,
                                               PAGE=page, BLOCK_N=block_n, SPLITS=splits, IEEE=q_BHD.dtype == torch.float32,
                                               WINDOW=window or 0, num_warps=4, num_stages=2)
        if splits > 1:
            _decode_combine_kernel[(B * HQ,)](part, ml, o, SPLITS=splits, D=D, num_warps=1)
        return o

    def prefill_attention(self, q_THD, k_cache, v_cache, meta: AttnMetadata, scale: float, window: int | None = None):
        T, HQ, D = q_THD.shape
        HKV, page = k_cache.shape[2], k_cache.shape[1]
        o = torch.empty_like(q_THD)
        bt = meta.block_tables_BN
        B = bt.shape[0]
        block_m = 64 if meta.max_query_len > 32 else 16
        grid = (triton.cdiv(meta.max_query_len, block_m), B, HQ)
        _paged_prefill_kernel[grid](q_THD.contiguous(), k_cache, v_cache, bt, meta.cu_seqlens_q_B1,
                                    meta.context_lens_B, o, scale, bt.stride(0), HQ, HKV, GROUP=HQ // HKV, D=D,
                                    PAGE=page, BLOCK_M=block_m, BLOCK_N=64, IEEE=q_THD.dtype == torch.float32,
                                    WINDOW=window or 0, num_warps=4, num_stages=2)
        return o
