"""One-pass sampling from logits on the GPU: temperature, an inverse-CDF draw and the token's logprob.

Covers the processed distributions without top-k/top-p filtering (``tidal.engine.sampler.sample``
uses it for those on CUDA). Each row is split over 16 programs that each keep a running log-sum-exp
of ``logits / T`` over their chunk (and, for ``temperature == 0``, the running argmax); a second
kernel per row merges them and draws: one uniform ``u`` per row, the chunk whose cumulative mass
first exceeds ``u * total`` (the chunk sums' prefix made monotone and flat over empty chunks, as in
:func:`tidal.engine.sampler.monotone_cdf`), then a scan of that chunk alone for the token whose
cumulative mass first exceeds the rest, falling back to the chunk's last token of positive mass.
So a draw costs one load of its row's uniform and one extra read of a sixteenth of the row, the
same two-level inversion as :func:`tidal.engine.sampler.inverse_cdf`. ``temperature == 0`` takes
the argmax and returns the untempered logprob, like :func:`tidal.engine.sampler.process_logits`.
The uniforms are the caller's (``u_B``, one fp32 per row: the engine's keyed uniforms,
:func:`tidal.engine.sampler.keyed_uniforms`), the ones the PyTorch path reads, so both paths draw
the same token for a row whatever the batch (up to the float rounding of the sums at an interval's
edge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_partial_kernel(logits_ptr, stride, V, CHUNK, inv_temp, part_ptr,
                           GREEDY: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr):
    # one program per (row, chunk of the vocabulary); per-lane running max / sum-exp (and best score
    # when greedy), combined across lanes, written as 4 partials that _sample_combine_kernel merges
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    lo = chunk * CHUNK
    for start in range(lo, lo + CHUNK, BLOCK):
        offs = start + lane
        mask = (offs < V) & (offs < lo + CHUNK)
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, x)
        seen = m_new > float("-inf")
        l = tl.where(seen, l * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
        if GREEDY:
            take = mask & (x > best)
            best = tl.where(take, x, best)
            best_i = tl.where(take, offs, best_i)
    m_all = tl.max(m, axis=0)
    l_all = tl.sum(tl.where(m > float("-inf"), l * tl.exp(m - m_all), 0.0), axis=0)
    win = tl.argmax(best, axis=0)
    base = part_ptr + (row * NCHUNK + chunk) * 4
    tl.store(base, m_all)
    tl.store(base + 1, l_all)
    tl.store(base + 2, tl.max(best, axis=0))  # greedy: the chunk's largest x, at token best_i
    tl.store(base + 3, tl.sum(tl.where(lane == win, best_i, 0), axis=0).to(tl.float32))


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _monotone_prefix(w):
    """Prefix sums of the non-negative ``w`` made non-decreasing and flat over zero weights."""
    cdf = tl.where(w > 0, tl.cumsum(w, axis=0), 0.0)
    return tl.associative_scan(cdf, 0, _max_combine)


@triton.jit
def _sample_combine_kernel(logits_ptr, stride, V, CHUNK, inv_temp, u_ptr, part_ptr, tok_ptr, logp_ptr,
                           GREEDY: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NCHUNK)
    base = part_ptr + (row * NCHUNK + c) * 4
    m = tl.load(base)
    l = tl.load(base + 1)
    m_all = tl.max(m, axis=0)
    mass = tl.where(m > float("-inf"), l * tl.exp(m - m_all), 0.0)  # each chunk's sum of exp(x - m_all)
    l_all = tl.sum(mass, axis=0)
    if GREEDY:
        best = tl.load(base + 2)
        win = tl.argmax(best, axis=0)
        x_tok = tl.max(best, axis=0)
        tok = tl.sum(tl.where(c == win, tl.load(base + 3), 0.0), axis=0).to(tl.int32)
    else:
        cdf = _monotone_prefix(mass)
        target = tl.load(u_ptr + row).to(tl.float32) * tl.max(cdf, axis=0)  # as inverse_cdf: u * total
        last = tl.max(tl.where(mass > 0, c, -1), axis=0)
        # first prefix above the target; a row without positive mass (non-finite logits: last == -1)
        # scans chunk 0 and finds no token (tok -2, tidal.engine.sampler.NO_TOKEN), never memory before the row
        ch = tl.maximum(tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), last), 0)
        rest = target - tl.sum(tl.where(c == ch - 1, cdf, 0.0), axis=0)
        # the chosen chunk's tokens, BLOCK at a time: the first whose running mass exceeds ``rest``
        lane = tl.arange(0, BLOCK)
        acc = rest * 0.0
        tok = ch * 0 - 1  # not found yet
        last_pos = ch * 0 - 1  # the chunk's last token of positive mass so far (with its x)
        x_tok = rest * 0.0
        x_last = rest * 0.0
        lo = ch * CHUNK
        for start in range(0, CHUNK, BLOCK):
            offs = lo + start + lane
            mask = (offs < V) & (start + lane < CHUNK)
            x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
            p = tl.where(mask, tl.exp(x - m_all), 0.0)
            run = acc + _monotone_prefix(p)
            hit = (p > 0) & (run > rest)
            first = tl.min(tl.where(hit, offs, 2147483647), axis=0)
            found = (tok < 0) & (first < 2147483647)
            x_tok = tl.where(found, tl.sum(tl.where(offs == first, x, 0.0), axis=0), x_tok)
            tok = tl.where(found, first, tok)
            pos_last = tl.max(tl.where(p > 0, offs, -1), axis=0)
            x_last = tl.where(pos_last >= 0, tl.sum(tl.where(offs == pos_last, x, 0.0), axis=0), x_last)
            last_pos = tl.maximum(last_pos, pos_last)
            acc = tl.max(run, axis=0)
        x_tok = tl.where(tok < 0, x_last, x_tok)
        tok = tl.where(tok < 0, tl.where(last_pos < 0, -2, last_pos), tok)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, x_tok - m_all - tl.log(l_all))


def fused_sample(logits_BV: torch.Tensor, temperature: float, u_B: torch.Tensor | None = None):
    """(token_B int64, logp_B fp32) drawn from ``softmax(logits / temperature)`` (argmax when 0):
    row b takes the token whose CDF interval holds ``u_B[b]`` (fp32 ``[B]`` on the device, read by
    the kernel, so a CUDA graph can capture this call over a buffer of uniforms; unused, and may be
    None, when greedy)."""
    B, V = logits_BV.shape
    if logits_BV.stride(1) != 1:
        logits_BV = logits_BV.contiguous()
    dev = logits_BV.device
    greedy = temperature == 0
    if u_B is None:
        if not greedy:
            raise ValueError("fused_sample: sampling (temperature > 0) needs one uniform per row")
        u_B = torch.zeros(B, dtype=torch.float32, device=dev)  # not read
    u_B = u_B.to(torch.float32).contiguous()
    nchunk = 16 if V >= 16 * 1024 else 1
    block = max(16, min(2048, triton.next_power_of_2(triton.cdiv(V, nchunk))))
    chunk = triton.cdiv(triton.cdiv(V, nchunk), block) * block
    part = torch.empty(B, nchunk, 4, dtype=torch.float32, device=dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    _sample_partial_kernel[(B, nchunk)](logits_BV, logits_BV.stride(0), V, chunk, inv_temp, part,
                                        GREEDY=greedy, BLOCK=block, NCHUNK=nchunk, num_warps=4)
    _sample_combine_kernel[(B,)](logits_BV, logits_BV.stride(0), V, chunk, inv_temp, u_B, part, tok, logp,
                                 GREEDY=greedy, BLOCK=block, NCHUNK=nchunk, num_warps=4)
    return tok, logp
