"""Exact mode's numerics: batch-invariant ops that the native engine and the trainer both run, so a
token's logprob is the same bits in the rollout and in the trainer (docs/exact.md).

A token's logprob must not depend on what else shares its forward: how many rows a matmul has, where
in a buffer its row sits, whether it came from prefill, decode, chunked prefill, a prefix hit or a
packed training row. Measured on PyTorch's CPU kernels (MKL/oneDNN, AVX-512), and checked by
tests/unit/test_exact.py on the machine that runs them:

- ``F.linear``: row i of ``x @ W^T`` changes with the number of rows M (a gemv at M=1, other
  blockings for small M, thread splits for large M), in fp32 and bf16. A call of a *fixed* shape
  gives each row the same bits wherever it sits in the call and whatever the other rows hold, and
  the result of an output column does not depend on the other columns (a fused q/k/v or gate/up
  projection equals the separate ones). So :func:`linear` runs every matmul as calls of exactly
  :data:`ROW_TILE` rows (the last tile padded with zero rows).
- Elementwise transcendental functions: ``F.silu``, ``torch.sigmoid``, ``F.softplus``, ``torch.tanh``
  and ``F.gelu`` take a SIMD path for most of a buffer and a scalar one for its tail, which round
  differently; ``torch.exp``, ``+ - * /``, ``sqrt`` and casts give the same bits on both paths. So
  they are recomposed from ``exp`` in fp32 (:func:`silu` etc.).
- Reductions along the last (contiguous) dim (``sum``, ``mean``, ``amax``, ``log_softmax``) are
  per row already: the same bits for any number of rows, also with trailing zeros.
- Attention is :func:`attention`: over fixed blocks of :data:`KV_BLOCK` key positions counted
  from position 0, in order, whatever the query's origin (a packed training row, a prefill chunk or
  a decode step); keys a query may not see weigh exactly 0.

:class:`ExactMode` (entered with :func:`exact_numerics`) swaps those functions for their invariant
forms inside any forward, the HF model's in the trainer and the native engine's alike; the
attention and the log-softmax are called explicitly by both sides' exact paths. Autograd runs
through all of it, so the training forward computes the same bits as the old logprobs.

What it does not know: which model runs, the trainer or the engine. Not covered: tensor parallelism
(an all-reduce sums shards in another order), CUDA kernels (GPU exact mode is unmeasured).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

ROW_TILE = 64  # rows per matmul call (all calls this shape); 4096x128 @ 128x384, one thread: 31 ms at 16 rows, 11 ms at 64
KV_BLOCK = 64  # key positions per attention block (a multiple of the SIMD width: no tails)
SEQ_GROUP = 16  # packed sequences attended in one call (memory: a group's scores are [G, L, H, L', D])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as calls of exactly :data:`ROW_TILE` rows: each output
    row depends only on its input row (and the weights), never on the other rows. Differentiable."""
    if active():  # called directly inside the mode: it routes F.linear back here, suspended
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, K)
    M = x_MK.shape[0]
    pad = (-M) % ROW_TILE
    if pad:
        x_MK = torch.cat([x_MK, x_MK.new_zeros(pad, K)])
    y = torch.cat([F.linear(tile, weight, bias) for tile in x_MK.split(ROW_TILE)]) if M else F.linear(x_MK, weight, bias)
    return y[:M].reshape(*lead, weight.shape[0])


def _fp32(fn):
    """``fn`` computed in fp32 (float64 stays float64) and cast back to the input's dtype."""
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return fn(wide).to(x.dtype)
    return wrapped


@_fp32
def sigmoid(x):
    """``1 / (1 + exp(-x))``."""
    return 1.0 / (1.0 + torch.exp(-x))


@_fp32
def silu(x):
    """``x / (1 + exp(-x))``."""
    return x / (1.0 + torch.exp(-x))


@_fp32
def tanh(x):
    """``1 - 2 / (exp(2x) + 1)`` (exact limits at +-inf)."""
    return 1.0 - 2.0 / (torch.exp(2.0 * x) + 1.0)


@_fp32
def softplus(x):
    """``log(1 + exp(x))``, ``x`` itself above 20 (``F.softplus``'s threshold)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp_max(20.0))))


@_fp32
def gelu_tanh(x):
    """GELU, tanh approximation (``F.gelu(x, approximate="tanh")``)."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (1.0 - 2.0 / (torch.exp(2.0 * inner) + 1.0)))


def _gelu(x, approximate: str = "none"):
    if approximate != "tanh":
        raise NotImplementedError("exact mode: only the tanh GELU (gelu_pytorch_tanh) has an invariant form")
    return gelu_tanh(x)


def _silu(x, inplace: bool = False):
    return x.copy_(silu(x)) if inplace else silu(x)


def _softplus(x, beta: float = 1.0, threshold: float = 20.0):
    if beta != 1.0 or threshold != 20.0:
        raise NotImplementedError("exact mode: F.softplus with beta/threshold other than 1/20")
    return softplus(x)


def topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """``torch.topk`` with an explicit tie-break: equal values in index order (the lowest index first,
    from a stable sort), on every side and every batch (an MoE router's choice between two experts of
    the same probability is then the same in the engine and the trainer)."""
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def index_add_(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, alpha=1) -> torch.Tensor:
    """``self.index_add_`` whose repeated indices add in the order they occur, each add rounded in
    ``self``'s dtype (a reduced-precision CPU kernel may sum repeats wider and round once): rounds
    of unique indices, round r taking each index's r-th occurrence. An MoE combine of a token's k
    expert outputs in one call then equals one call per expert (``transformers``' experts loop)."""
    order = torch.argsort(index, stable=True)
    sorted_idx = index[order]
    first = torch.ones_like(sorted_idx, dtype=torch.bool)
    first[1:] = sorted_idx[1:] != sorted_idx[:-1]
    pos = torch.arange(index.numel(), device=index.device)
    start = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), 0).values
    occurrence = torch.empty_like(pos)
    occurrence[order] = pos - start
    rounds = int(occurrence.max()) + 1 if index.numel() else 0
    if rounds <= 1:
        return self.index_add_(dim, index, source, alpha=alpha)
    for r in range(rounds):
        take = (occurrence == r).nonzero().squeeze(-1)
        self.index_add_(dim, index[take], source.index_select(dim, take), alpha=alpha)
    return self


_SWAPS = {
    torch.Tensor.index_add_: index_add_,
    torch.topk: topk,
    torch.Tensor.topk: topk,
    F.linear: linear,
    F.silu: _silu,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
    F.sigmoid: sigmoid,
    torch.tanh: tanh,
    torch.Tensor.tanh: tanh,
    F.gelu: _gelu,
    F.softplus: _softplus,
}


class ExactMode(TorchFunctionMode):
    """Swaps the functions of :data:`_SWAPS` for their invariant forms while entered."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        swap = _SWAPS.get(func)
        if func is F.scaled_dot_product_attention:
            raise RuntimeError("exact mode: scaled_dot_product_attention is not batch-invariant; this forward must "
                               "run tidal.exact.attention (a model path exact mode does not cover)")
        return (swap or func)(*args, **(kwargs or {}))


def exact_numerics(enabled: bool = True):
    """Context manager: :class:`ExactMode` when ``enabled``, else nothing."""
    return ExactMode() if enabled else contextlib.nullcontext()


def active() -> bool:
    """Whether an :class:`ExactMode` is entered (and not suspended inside one of its swaps)."""
    return any(isinstance(m, ExactMode) for m in _get_current_function_mode_stack())


def attention(
    q_GQHD: torch.Tensor, k_GTKD: torch.Tensor, v_GTKD: torch.Tensor, qpos_GQ: torch.Tensor, klen_G: torch.Tensor,
    scale: float, window: int | None = None,
) -> torch.Tensor:
    """``out[g, i] = softmax(scale * q[g, i] K_g^T) V_g`` over the keys ``j < klen_G[g]`` with
    ``j <= qpos_GQ[g, i]`` (and ``qpos - j < window``), key ``j`` being ``k_GTKD[g, j]``: G groups
    (sequences) of Q queries each, K key heads dividing H (grouped-query attention). Returns
    ``[G, Q, H, D]`` in q's dtype.

    Batch-invariant: a query's result depends on its own q, its position and its sequence's keys
    only, never on G, Q or how many key positions T were padded in. fp32 math over fixed blocks of
    :data:`KV_BLOCK` keys from position 0: the scores (a per-row sum over D), the max over all keys,
    ``exp(s - max)`` (0 where masked), then per block the sums over its keys (last-dim reductions of a
    fixed length), blocks added in order; a block a query cannot see adds exact zeros."""
    G, Q, H, D = q_GQHD.shape
    T, Kh = k_GTKD.shape[1], k_GTKD.shape[2]
    nb = max(1, -(-T // KV_BLOCK))
    pad = nb * KV_BLOCK - T
    k = F.pad(k_GTKD.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(H // Kh, dim=2)  # [G, T', H, D]
    v = F.pad(v_GTKD.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(H // Kh, dim=2)
    q = q_GQHD.float()
    kpos = torch.arange(nb * KV_BLOCK, device=q.device)
    qpos = qpos_GQ[:, :, None]
    visible_GQT = (kpos[None, None, :] <= qpos) & (kpos[None, None, :] < klen_G[:, None, None])
    if window is not None:
        visible_GQT &= kpos[None, None, :] > qpos - window
    # scores [G, Q, H, T']: a last-dim (contiguous) sum over D per (query, head, key)
    s = (q[:, :, :, None, :] * k.permute(0, 2, 1, 3).contiguous()[:, None]).contiguous().sum(-1) * scale
    s = s.masked_fill(~visible_GQT[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # a query with no key: all weights 0
    p = torch.exp(s - m)  # masked: exp(-inf) = 0
    num = q.new_zeros(G, Q, H, D)
    den = q.new_zeros(G, Q, H, 1)
    for b in range(nb):
        blk = slice(b * KV_BLOCK, (b + 1) * KV_BLOCK)
        p_b = p[..., blk].contiguous()  # [G, Q, H, B]
        vT_b = v[:, blk].permute(0, 2, 3, 1).contiguous()  # [G, H, D, B]
        num = num + (p_b[:, :, :, None, :] * vT_b[:, None]).contiguous().sum(-1)
        den = den + p_b.sum(-1, keepdim=True)
    # a query that sees a key has den >= 1 (its max key weighs exactly 1); one that sees none (a
    # padding row of a group) gets 0, not 0/0, whose NaN would reach the gradient through the discarded row
    return (num / torch.where(den > 0, den, torch.ones_like(den))).to(q_GQHD.dtype)


def varlen_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float | None, window: int | None) -> torch.Tensor:
    """Causal attention of packed sequences (``cu_seqlens``, :mod:`tidal.models.varlen`) through
    :func:`attention`, token ``i`` of a sequence at position ``i``: the sequences in groups of
    :data:`SEQ_GROUP`, each padded to its group's longest (a query's bits do not depend on its group)."""
    scale = q_NHD.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q_NHD)
    bounds = cu_seqlens.tolist()
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    for g in range(0, len(spans), SEQ_GROUP):
        group = spans[g : g + SEQ_GROUP]
        L = max(b - a for a, b in group)
        q, k, v = (torch.stack([F.pad(x[a:b], (0, 0, 0, 0, 0, L - (b - a))) for a, b in group]) for x in (q_NHD, k_NKD, v_NKD))
        pos = torch.arange(L, device=q_NHD.device).expand(len(group), L)
        klen = torch.tensor([b - a for a, b in group], device=q_NHD.device)
        o = attention(q, k, v, pos, klen, scale, window)
        for i, (a, b) in enumerate(group):
            out[a:b] = o[i, : b - a]
    return out
