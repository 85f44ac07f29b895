"""The LM head's log-probabilities and entropies under the processed distribution, chunked.

Layout: ``logp_BT[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` under the processed
distribution of a :class:`~tidal.sampling_filter.SamplingFilter` (``softmax(logits / T)`` renormalised
over the support that top-k, min-p and top-p keep, the one definition the engine samples from; the
scored token is always inside it); position 0 has no prediction and is 0. The entropy is that of the
same distribution. With a filter, each chunk's per-row support threshold is found eagerly
(:func:`tidal.sampling_filter.support_threshold`, which sorts blocks of rows for top-p) and kept for
the backward (one number per row), which treats the support as fixed: the gradient of the
renormalised logprob is zero outside it. The LM head is one autograd function
(:class:`_LMHeadLogprobs`) over chunks of hidden-state rows: the forward keeps per row only
``logZ``, ``log p(label)`` and the entropy (fp32), never the logits; the backward recomputes each
chunk's logits and applies the closed-form softmax gradient, so peak extra memory is one chunk of
logits (in the model's dtype) plus one fp32 ``[V, H]`` weight-gradient accumulator. On CUDA the
two full-vocabulary passes (:func:`_stats`, :func:`_dlogits`) run through ``torch.compile``, which
fuses them into a few reads of the chunk's logits, unless ``compile_head`` says otherwise (set per
model by the strategy that prepares it: :func:`tidal.models.logprobs.set_head_compile`).
What it does not know: the model's body, packing (:mod:`tidal.models.logprobs` and
:mod:`tidal.models.packing` run the body and hand it hidden states).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tidal.sampling_filter import SamplingFilter, mask_outside, support_threshold

# ---- the full-vocabulary passes (compiled on CUDA) ----------------------------------------------
_COMPILED: dict[Callable, Callable] = {}  # the compiled passes, created on first use (a cache, no setting)


def _run(fn: Callable, compile_head: bool, logits_NV: torch.Tensor, *args):
    """``fn(logits_NV, *args)``, through ``torch.compile(dynamic=True)`` when ``compile_head`` and
    the logits are CUDA tensors (CPU tensors always run eagerly). Both paths run the same Python
    functions; the compiled one may round differently in the last fp32 bits (fused reductions). A
    single row runs eagerly: ``torch.compile`` specialises sizes 0 and 1, so a one-row chunk (a
    micro-batch whose last chunk holds one token) would otherwise recompile in steady state."""
    if compile_head and logits_NV.is_cuda and logits_NV.shape[0] > 1:
        compiled = _COMPILED.get(fn)
        if compiled is None:
            compiled = _COMPILED[fn] = torch.compile(fn, dynamic=True)
        fn = compiled
    return fn(logits_NV, *args)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax math and the gradient sums use for inputs of ``dtype``: fp32, or
    float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its math dtype (:func:`_math_dtype`)."""
    return x.to(_math_dtype(x.dtype))


def _finite(z_NV: torch.Tensor, threshold_N: torch.Tensor | None) -> torch.Tensor:
    """``z`` with its ``-inf`` (outside the support) made the dtype's lowest finite value, so that
    ``p * z`` is 0 there rather than NaN (unchanged without a support threshold)."""
    return z_NV if threshold_N is None else z_NV.clamp_min(torch.finfo(z_NV.dtype).min)


def _stats(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: float, with_entropy: bool,
    threshold_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``z = logits / T`` (fp32 math, see :func:`_widen`), ``-inf`` below ``threshold_N``
    (:func:`tidal.sampling_filter.mask_outside`; None: no filter): ``logp_N = z[label] - logZ``,
    ``logz_N = logsumexp(z)`` and ``entropy_N = logZ - sum_k p_k z_k`` (``= -sum p log p``; zeros
    without ``with_entropy``)."""
    z_NV = mask_outside(_widen(logits_NV) / temperature, threshold_N)
    logz_N = torch.logsumexp(z_NV, dim=-1)
    logp_N = z_NV.gather(-1, labels_N[:, None]).squeeze(-1) - logz_N
    if with_entropy:
        entropy_N = logz_N - (torch.exp(z_NV - logz_N[:, None]) * _finite(z_NV, threshold_N)).sum(-1)
    else:
        entropy_N = torch.zeros_like(logz_N)
    return logp_N, logz_N, entropy_N


def _dlogits(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, logz_N: torch.Tensor, entropy_N: torch.Tensor,
    g_logp_N: torch.Tensor, g_ent_N: torch.Tensor | None, temperature: float, threshold_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. the logits of ``sum_n g_logp_n logp_n + g_ent_n H_n``, computed in fp32 (see
    :func:`_widen`) and returned in the logits' dtype.

    With ``z = logits / T``, ``p = softmax(z)``, ``H = -sum_k p_k log p_k``:
    ``dL/dz_k = g_logp (1[k = label] - p_k) - g_ent p_k (log p_k + H)`` and ``dL/dlogits = dL/dz / T``.
    ``g_ent_N`` None: the entropy carries no gradient (its term is skipped). ``threshold_N``: the
    support of :func:`_stats` (``p_k = 0`` outside it, so its gradient is 0 there).
    """
    logp_NV = mask_outside(_widen(logits_NV) / temperature, threshold_N) - logz_N[:, None]
    p_NV = torch.exp(logp_NV)
    onehot_NV = torch.arange(logits_NV.shape[-1], device=logits_NV.device)[None, :] == labels_N[:, None]
    dz_NV = g_logp_N[:, None] * (onehot_NV.to(p_NV.dtype) - p_NV)
    if g_ent_N is not None:
        dz_NV = dz_NV - g_ent_N[:, None] * p_NV * (_finite(logp_NV, threshold_N) + entropy_N[:, None])
    return (dz_NV / temperature).to(logits_NV.dtype)


# ---- the LM head as one autograd function ------------------------------------------------------------
def _add_mm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` accumulated in fp32 or wider (``acc`` None: the first term)."""
    if acc is None:
        return _widen(torch.mm(a, b))
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    return acc.add_(torch.mm(a, b))


class _LMHeadLogprobs(torch.autograd.Function):
    """``(logp_N, entropy_N) = f(hidden_NH, weight_VH, bias_V, labels_N)``: row n's label logprob and
    entropy under the processed distribution (``sampling``) of ``hidden_n @ W^T + b``, both fp32
    (float64 for float64 inputs).

    The logits are ``F.linear`` in the inputs' dtype (hidden, weight and bias share it), then fp32
    for the softmax math. Saved for backward: the inputs and ``logZ_N``, ``entropy_N`` and, with a
    filter, each row's support threshold (no logits).
    The entropy is differentiable only with ``with_entropy and entropy_grad``. Gradients: ``dW``
    and ``db`` accumulate over chunks in fp32 and are returned in the weight's dtype; ``dh`` in the
    hidden dtype. Only the inputs that need a gradient get one.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, sampling: SamplingFilter, with_entropy: bool,
                entropy_grad: bool, chunk_tokens: int, compile_head: bool):
        N = hidden_NH.shape[0]
        stat_dtype = _math_dtype(hidden_NH.dtype)
        logp_N, logz_N, entropy_N = (hidden_NH.new_empty(N, dtype=stat_dtype) for _ in range(3))
        thr_N = hidden_NH.new_empty(N, dtype=stat_dtype) if sampling.filters else None
        T = sampling.scale
        for s in range(0, N, chunk_tokens):
            e = min(s + chunk_tokens, N)
            logits_cV = F.linear(hidden_NH[s:e], weight_VH, bias_V)
            thr_c = None
            if thr_N is not None:  # eager (sorts); the compiled pass only compares against it
                thr_c = thr_N[s:e] = support_threshold(logits_cV, sampling, labels_N[s:e])
            logp_N[s:e], logz_N[s:e], entropy_N[s:e] = _run(_stats, compile_head, logits_cV, labels_N[s:e], T, with_entropy, thr_c)
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, labels_N, logz_N, entropy_N, thr_N)
        ctx.temperature, ctx.chunk_tokens, ctx.compile_head = T, chunk_tokens, compile_head
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy_N)
        # the gradient of an unused or non-differentiable output arrives as None: its term is skipped
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        hidden_NH, weight_VH, bias_V, labels_N, logz_N, entropy_N, thr_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp_N is None:
            g_logp_N = torch.zeros_like(logz_N)
        N, T = hidden_NH.shape[0], ctx.temperature
        dh_NH = torch.empty_like(hidden_NH) if need_h else None
        dw_VH = db_V = None
        for s in range(0, N, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, N)
            h_cH = hidden_NH[s:e]
            logits_cV = F.linear(h_cH, weight_VH, bias_V)
            g_ent_c = None if g_ent_N is None else g_ent_N[s:e]
            thr_c = None if thr_N is None else thr_N[s:e]
            dlogits_cV = _run(_dlogits, ctx.compile_head, logits_cV, labels_N[s:e], logz_N[s:e], entropy_N[s:e], g_logp_N[s:e], g_ent_c, T,
                              thr_c)
            del logits_cV
            if need_h:
                torch.mm(dlogits_cV, weight_VH, out=dh_NH[s:e])
            if need_w:
                dw_VH = _add_mm(dw_VH, dlogits_cV.t(), h_cH)
            if need_b:
                db_c = dlogits_cV.sum(0, dtype=_math_dtype(dlogits_cV.dtype))
                db_V = db_c if db_V is None else db_V.add_(db_c)
        if need_w:
            dw_VH = torch.zeros_like(weight_VH) if dw_VH is None else dw_VH.to(weight_VH.dtype)
        if need_b:
            db_V = torch.zeros_like(bias_V) if db_V is None else db_V.to(bias_V.dtype)
        return dh_NH, dw_VH, db_V, None, None, None, None, None, None


def head_logprobs(
    hidden_NH: torch.Tensor,
    lm_head: torch.nn.Linear,
    labels_N: torch.Tensor,
    *,
    sampling: SamplingFilter = SamplingFilter(),
    with_entropy: bool = False,
    chunk_tokens: int = 2048,
    entropy_grad: bool = True,
    compile_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row n: ``log p(labels_N[n])`` and the entropy under the processed distribution
    (``sampling``) of ``lm_head(hidden_NH[n])`` (fp32, float64 for a float64 model; entropies None
    without ``with_entropy``). The rows are
    already the predicting hidden states (row n predicts ``labels_N[n]``); the other arguments are
    those of :func:`lm_head_logprobs`."""
    logp_N, entropy_N = _LMHeadLogprobs.apply(
        hidden_NH, lm_head.weight, lm_head.bias, labels_N, sampling, with_entropy, entropy_grad, chunk_tokens,
        compile_head,
    )
    return logp_N, entropy_N if with_entropy else None


def lm_head_logprobs(
    hidden_BTH: torch.Tensor,
    lm_head: torch.nn.Linear,
    input_ids_BT: torch.Tensor,
    *,
    sampling: SamplingFilter = SamplingFilter(),
    with_entropy: bool = False,
    chunk_tokens: int = 2048,
    entropy_grad: bool = True,
    positions_BT: torch.Tensor | None = None,
    compile_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the next tokens from decoder hidden states.

    hidden_BTH[b, t] predicts input_ids[b, t+1], under the processed distribution ``sampling``
    (temperature and filters, :mod:`tidal.sampling_filter`). Returns fp32 tensors [B, T] (float64 for a float64
    model) aligned with input_ids (position 0 is 0), and None for the entropies without
    ``with_entropy``. ``entropy_grad=False``: the entropies carry no gradient (same values; no
    backward through the full-vocabulary softmax for them), for when they are only a metric or a
    token mask. ``positions_BT`` (bool or 0/1,
    [B, T]): compute only the positions where it is true (its column 0 is ignored); every other
    position is exactly 0 in both outputs and gets no gradient (selecting costs one host sync).
    ``chunk_tokens``: rows of logits held at once. ``lm_head.weight``/``bias`` and ``hidden_BTH``
    must share a dtype. ``compile_head``: run the full-vocabulary passes compiled on CUDA (see :func:`_run`).
    """
    B, T, H = hidden_BTH.shape
    weight_VH, bias_V = lm_head.weight, lm_head.bias
    args = (sampling, with_entropy, entropy_grad, chunk_tokens, compile_head)
    if positions_BT is None:
        hidden_NH = hidden_BTH[:, :-1].reshape(-1, H)
        labels_N = input_ids_BT[:, 1:].reshape(-1)
        logp_N, entropy_N = _LMHeadLogprobs.apply(hidden_NH, weight_VH, bias_V, labels_N, *args)
        zeros_B1 = logp_N.new_zeros(B, 1)
        logp_BT = torch.cat([zeros_B1, logp_N.view(B, T - 1)], dim=1)
        entropy_BT = torch.cat([zeros_B1, entropy_N.view(B, T - 1)], dim=1) if with_entropy else None
        return logp_BT, entropy_BT
    if positions_BT.shape != (B, T):
        raise ValueError(f"positions_BT has shape {tuple(positions_BT.shape)}, expected {(B, T)}")
    # flat index b*T + t of each selected target; its hidden row is the one before it
    selected_BT = positions_BT.to(device=hidden_BTH.device, dtype=torch.bool, copy=True)
    selected_BT[:, 0] = False
    idx_M = selected_BT.view(-1).nonzero().squeeze(-1)
    hidden_MH = hidden_BTH.reshape(B * T, H).index_select(0, idx_M - 1)
    labels_M = input_ids_BT.reshape(-1).index_select(0, idx_M)
    logp_M, entropy_M = _LMHeadLogprobs.apply(hidden_MH, weight_VH, bias_V, labels_M, *args)
    # out-of-place index_put: fresh [B, T] tensors, not views (FSDP2 warns about outputs that are views)
    rows_cols = (idx_M // T, idx_M % T)
    zeros_BT = logp_M.new_zeros(B, T)
    logp_BT = zeros_BT.index_put(rows_cols, logp_M)
    entropy_BT = zeros_BT.index_put(rows_cols, entropy_M) if with_entropy else None
    return logp_BT, entropy_BT
