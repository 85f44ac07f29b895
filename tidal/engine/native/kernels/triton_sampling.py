"""One-pass sampling from logits on the GPU: temperature, Gumbel-max draw and the token's logprob.

Covers the processed distributions without top-k/top-p filtering (``tidal.engine.sampler.sample``
uses it for those on CUDA): each row is read once, in blocks, keeping a running log-sum-exp and the
running best of ``logits / T + Gumbel noise``. ``temperature == 0`` takes the argmax and returns the
untempered logprob, like :func:`tidal.engine.sampler.process_logits`. The noise comes from Triton's
Philox stream keyed by a seed drawn from the caller's generator, so seeded runs are reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(logits_ptr, stride, V, inv_temp, seed_ptr, tok_ptr, logp_ptr,
                   GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    # per-lane running max / sum-exp / best score, combined across lanes at the end
    row = tl.program_id(0)
    seed = tl.load(seed_ptr)
    lane = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_x = tl.zeros([BLOCK], tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + lane
        mask = offs < V
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, x)
        seen = m_new > float("-inf")
        l = tl.where(seen, l * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
        if GREEDY:
            score = x
        else:
            u = tl.rand(seed, row * V + offs)
            score = x - tl.log(-tl.log(tl.maximum(u, 1e-20)))
        take = mask & (score > best)
        best = tl.where(take, score, best)
        best_x = tl.where(take, x, best_x)
        best_i = tl.where(take, offs, best_i)
    m_all = tl.max(m, axis=0)
    l_all = tl.sum(tl.where(m > float("-inf"), l * tl.exp(m - m_all), 0.0), axis=0)
    win = tl.argmax(best, axis=0)
    tok = tl.sum(tl.where(lane == win, best_i, 0), axis=0)
    x_win = tl.sum(tl.where(lane == win, best_x, 0.0), axis=0)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, x_win - m_all - tl.log(l_all))


def fused_sample(logits_BV: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """(token_B int64, logp_B fp32) drawn from ``softmax(logits / temperature)`` (argmax when 0)."""
    B, V = logits_BV.shape
    if logits_BV.stride(1) != 1:
        logits_BV = logits_BV.contiguous()
    seed = torch.randint(0, 2**31 - 1, (1,), device=logits_BV.device, generator=generator, dtype=torch.int64)
    tok = torch.empty(B, dtype=torch.int64, device=logits_BV.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    _sample_kernel[(B,)](logits_BV, logits_BV.stride(0), V, inv_temp, seed, tok, logp,
                         GREEDY=temperature == 0, BLOCK=min(4096, triton.next_power_of_2(V)), num_warps=8)
    return tok, logp
