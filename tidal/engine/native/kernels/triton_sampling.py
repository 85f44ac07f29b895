"""One-pass sampling from logits on the GPU: temperature, Gumbel-max draw and the token's logprob.

Covers the processed distributions without top-k/top-p filtering (``tidal.engine.sampler.sample``
uses it for those on CUDA): each row is read once, split over 16 programs that each keep a running
log-sum-exp and the running best of ``logits / T + Gumbel noise``; a second tiny kernel merges them. ``temperature == 0`` takes the argmax and returns the
untempered logprob, like :func:`tidal.engine.sampler.process_logits`. The noise comes from Triton's
Philox stream keyed by a seed drawn from the caller's generator, so seeded runs are reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_partial_kernel(logits_ptr, stride, V, CHUNK, inv_temp, seed_ptr, part_ptr,
                           GREEDY: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr):
    # one program per (row, chunk of the vocabulary); per-lane running max / sum-exp / best score,
    # combined across lanes, written as 5 partials that _sample_combine_kernel merges per row
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr)
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_x = tl.zeros([BLOCK], tl.float32)
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
            score = x
        else:
            # one Philox call per 4 lanes (the random-number math is part of what bounds this kernel,
            # not its memory traffic; four at a time measured 0.127 -> 0.107 ms at 128 x 151936):
            # counters (row, chunk, group of 4 lanes) are distinct, so every element gets its own uniform
            q = (row * NCHUNK + chunk) * (CHUNK // 4) + (start - lo) // 4 + tl.arange(0, BLOCK // 4)
            r0, r1, r2, r3 = tl.rand4x(seed, q)
            u = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
            score = x - tl.log(-tl.log(tl.maximum(u, 1e-20)))
        take = mask & (score > best)
        best = tl.where(take, score, best)
        best_x = tl.where(take, x, best_x)
        best_i = tl.where(take, offs, best_i)
    m_all = tl.max(m, axis=0)
    l_all = tl.sum(tl.where(m > float("-inf"), l * tl.exp(m - m_all), 0.0), axis=0)
    win = tl.argmax(best, axis=0)
    base = part_ptr + (row * NCHUNK + chunk) * 5
    tl.store(base, m_all)
    tl.store(base + 1, l_all)
    tl.store(base + 2, tl.max(best, axis=0))
    tl.store(base + 3, tl.sum(tl.where(lane == win, best_x, 0.0), axis=0))
    tl.store(base + 4, tl.sum(tl.where(lane == win, best_i, 0), axis=0).to(tl.float32))


@triton.jit
def _sample_combine_kernel(part_ptr, tok_ptr, logp_ptr, NCHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, NCHUNK)
    base = part_ptr + (row * NCHUNK + c) * 5
    m = tl.load(base)
    l = tl.load(base + 1)
    best = tl.load(base + 2)
    m_all = tl.max(m, axis=0)
    l_all = tl.sum(tl.where(m > float("-inf"), l * tl.exp(m - m_all), 0.0), axis=0)
    win = tl.argmax(best, axis=0)
    x_win = tl.sum(tl.where(c == win, tl.load(base + 3), 0.0), axis=0)
    tok = tl.sum(tl.where(c == win, tl.load(base + 4), 0.0), axis=0)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, x_win - m_all - tl.log(l_all))


def draw_seed(generator: torch.Generator | None, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Philox seed of one draw, ``int64 [1]`` on the device, from ``generator`` (the default CUDA
    generator when None); written into ``out`` when given (a captured graph's seed buffer)."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, generator=generator, dtype=torch.int64, out=out)


def fused_sample(logits_BV: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                 *, seed: torch.Tensor | None = None):
    """(token_B int64, logp_B fp32) drawn from ``softmax(logits / temperature)`` (argmax when 0).
    The noise is keyed by ``seed`` (``int64 [1]`` on the device, read by the kernel: a CUDA graph
    can capture this call) or, when None, by a seed drawn from ``generator``."""
    B, V = logits_BV.shape
    if logits_BV.stride(1) != 1:
        logits_BV = logits_BV.contiguous()
    dev = logits_BV.device
    if seed is None:
        seed = draw_seed(generator, dev)
    nchunk = 16 if V >= 16 * 1024 else 1
    block = max(16, min(2048, triton.next_power_of_2(triton.cdiv(V, nchunk))))  # >= 16: 4 lanes per Philox call
    chunk = triton.cdiv(triton.cdiv(V, nchunk), block) * block
    part = torch.empty(B, nchunk, 5, dtype=torch.float32, device=dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    _sample_partial_kernel[(B, nchunk)](logits_BV, logits_BV.stride(0), V, chunk, inv_temp, seed, part,
                                        GREEDY=temperature == 0, BLOCK=block, NCHUNK=nchunk, num_warps=4)
    _sample_combine_kernel[(B,)](part, tok, logp, NCHUNK=nchunk, num_warps=1)
    return tok, logp
