"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024), the linear attention of Qwen3.5's hybrid
layers: the causal short convolution and the gated delta rule, each on one sequence's new tokens
(prefill, chunked) or on a batch of one-token rows (decode, recurrent), each taking and returning
the per-sequence state. The engine's layer (:mod:`tidal.engine.native.models.qwen3_5`) and packed
training (:mod:`tidal.models.linear_attention`) both call these; ``transformers``' modules define
the semantics they match.

The step, per value head (``q``, ``k`` L2-normalised, ``q`` scaled by ``dk ** -0.5``; a query/key
head serves ``Hv / Hk`` consecutive value heads)::

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)     S: [dk, dv]
    o_t = S_t^T q_t

The chunked form (chunks of ``C`` tokens, ``gamma`` the cumulative log decay inside a chunk, ``D_ij =
exp(gamma_i - gamma_j)`` for ``j <= i``) solves for a chunk's ``u`` at once: ``(I + A) u = beta v -
beta exp(gamma) K S_0`` with ``A_ij = beta_i D_ij k_i.k_j`` for ``j < i`` (unit lower triangular);
then ``o = exp(gamma) Q S_0 + (Q K^T * D) u`` and ``S_C = exp(gamma_C) S_0 + (exp(gamma_C - gamma) K)^T u``.
All of it runs in float32 (the state is float32); outputs come back in the inputs' dtype.

The short convolution is depthwise and causal over the last ``K`` inputs (``K`` the kernel width),
followed by SiLU; its state is the last ``K - 1`` inputs ``[C, K - 1]`` (zeros before the first token).

On CUDA, :func:`fla_available` tells whether flash-linear-attention's Triton kernels (the optional
``fla`` extra, ``pip install flash-linear-attention``) can replace the torch forms; they are imported
only when used. This module is torch-only otherwise and knows nothing about slots or batches.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tidal import optional_deps

CHUNK = 64  # tokens per chunk of the chunked form (HF's and fla's default)


@functools.cache
def fla_available() -> bool:
    """Whether a supported flash-linear-attention is installed (the ``fla`` extra; its kernels run
    on CUDA only)."""
    return optional_deps.problem("fla") is None


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` along the last dim (fla's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, num_v_heads: int):
    """float32 inputs with q/k normalised, q scaled and q/k heads repeated for the value heads."""
    rep = num_v_heads // q.shape[-2]
    q, k = (l2_normalize(x.float()).repeat_interleave(rep, dim=-2) if rep > 1 else l2_normalize(x.float()) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def chunk_gated_delta_rule(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    state_HKV: torch.Tensor | None = None, *, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's ``T`` new tokens, from ``state_HKV`` (float32
    ``[Hv, dk, dv]``; None: zeros). ``q``/``k``: ``[T, Hk, dk]`` (not normalised), ``v``: ``[T, Hv, dv]``,
    ``g`` (log decay, <= 0) and ``beta``: ``[T, Hv]``. Returns (``o_THV`` in ``v``'s dtype, the state
    after the last token, float32). Differentiable (packed training runs it under autograd)."""
    T, Hv, dv = v_THV.shape
    q, k, v, g, beta = _prepare(q_THK, k_THK, v_THV, g_TH, beta_TH, Hv)
    dk = q.shape[-1]
    S = torch.zeros(Hv, dk, dv, dtype=torch.float32, device=v.device) if state_HKV is None else state_HKV.float()
    pad = (-T) % chunk  # padded tokens: k = 0, beta = 0, g = 0 leave the state as it is
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    # [Hv, n, C, *]
    q, k, v = (x.view(n, chunk, Hv, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.view(n, chunk, Hv).permute(2, 0, 1) for x in (g, beta))
    gamma = g.cumsum(-1)
    causal_CC = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    diff = gamma[..., :, None] - gamma[..., None, :]
    D = torch.where(causal_CC, diff, torch.full_like(diff, float("-inf"))).exp()  # 0 above the diagonal
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * D).tril(-1)
    rhs = torch.cat((beta[..., None] * v, (beta * gamma.exp())[..., None] * k), dim=-1)
    X = unit_lower_inverse(A) @ rhs
    Xv, Xk = X[..., :dv], X[..., dv:]
    QKD = (q @ k.transpose(-1, -2)) * D
    q_dec = q * gamma.exp()[..., None]
    k_dec = k * (gamma[..., -1:] - gamma).exp()[..., None]
    last = gamma[..., -1].exp()[..., None, None]
    outs = []
    for c in range(n):
        u = Xv[:, c] - Xk[:, c] @ S
        outs.append(q_dec[:, c] @ S + QKD[:, c] @ u)
        S = last[:, c] * S + k_dec[:, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=1).reshape(Hv, n * chunk, dv)[:, :T].transpose(0, 1)
    return o.to(v_THV.dtype), S


def unit_lower_inverse(A_CC: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower triangular ``A`` (batched ``[..., C, C]``): ``A`` is
    nilpotent, so ``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...`` up to ``A^(2^m)`` with ``2^(m+1) >= C``,
    ``2 log2 C`` batched matmuls (a batched triangular solve is a loop of small ones on CPU)."""
    C = A_CC.shape[-1]
    inv = torch.eye(C, dtype=A_CC.dtype, device=A_CC.device) - A_CC
    power, span = A_CC @ A_CC, 2
    while span < C:
        inv = inv + inv @ power
        power, span = power @ power, 2 * span
    return inv


def recurrent_gated_delta_rule(
    q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor, beta_BH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> torch.Tensor:
    """One token of each of ``B`` sequences: updates ``state_BHKV`` (float32 ``[B, Hv, dk, dv]``) in
    place and returns ``o_BHV`` in ``v``'s dtype. Shapes as :func:`chunk_gated_delta_rule` without T."""
    q, k, v, g, beta = _prepare(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, v_BHV.shape[-2])
    S = state_BHKV * g.exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., :, None] * u[..., None, :]
    state_BHKV.copy_(S)
    return torch.einsum("bhk,bhkv->bhv", q, S).to(v_BHV.dtype)


def causal_conv1d(
    x_TC: torch.Tensor, weight_CK: torch.Tensor, state_CW: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal convolution of one sequence's ``T`` new inputs ``x_TC``, continuing
    from ``state_CW`` (its last ``W = K - 1`` inputs; None: zeros). Returns (``y_TC``, the new state:
    the last ``W`` inputs, earlier state included when ``T < W``). Differentiable."""
    T, C = x_TC.shape
    W = weight_CK.shape[1] - 1
    if state_CW is None:
        state_CW = x_TC.new_zeros(C, W)
    window_CL = torch.cat((state_CW.to(x_TC.dtype), x_TC.t()), dim=1)  # [C, W + T]
    y = F.conv1d(window_CL[None].to(weight_CK.dtype), weight_CK[:, None, :], groups=C)[0]  # [C, T]
    return F.silu(y).to(x_TC.dtype).t(), window_CL[:, T:]


def causal_conv1d_step(x_BC: torch.Tensor, weight_CK: torch.Tensor, state_BCW: torch.Tensor) -> torch.Tensor:
    """One input per sequence: returns ``y_BC`` and shifts ``x_BC`` into ``state_BCW`` in place."""
    window_BCK = torch.cat((state_BCW, x_BC[..., None].to(state_BCW.dtype)), dim=-1)
    state_BCW.copy_(window_BCK[..., 1:])
    y = (window_BCK.to(weight_CK.dtype) * weight_CK).sum(-1)
    return F.silu(y).to(x_BC.dtype)


# ---- flash-linear-attention (CUDA; the optional ``fla`` extra; not testable on CPU) -------------
def _repeat_heads(q, k, num_v_heads: int):
    rep = num_v_heads // q.shape[-2]
    return (q, k) if rep == 1 else (q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2))


def fla_chunk_varlen(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, cu_seqlens, state_SHKV=None):  # pragma: no cover
    """:func:`chunk_gated_delta_rule` of the packed sequences ``cu_seqlens`` (long ``[S + 1]``) in
    one flash-linear-attention call, from ``state_SHKV`` (None: zeros). Returns (``o_NHV``, the
    final states ``[S, Hv, dk, dv]`` float32 or None without initial states)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    q, k = _repeat_heads(q_NHK, k_NHK, v_NHV.shape[-2])
    o, final = fla_chunk(q[None], k[None], v_NHV[None], g=g_NH[None].float(), beta=beta_NH[None], initial_state=state_SHKV,
                         output_final_state=state_SHKV is not None, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    return o[0], None if final is None else final.float()


def fla_recurrent_step(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, state_BHKV):  # pragma: no cover
    """:func:`recurrent_gated_delta_rule` through flash-linear-attention's fused recurrent kernel."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_step

    q, k = _repeat_heads(q_BHK, k_BHK, v_BHV.shape[-2])
    # every argument after q, k, v by keyword: fla 0.6 put ``gk`` and ``gv`` between ``g`` and ``beta``, and a
    # positional ``beta`` became a key-wise gate read out of its bounds (the Qwen3.5 GPU crash, issue 50)
    o, final = fla_step(q[:, None], k[:, None], v_BHV[:, None], g=g_BH[:, None].float(), beta=beta_BH[:, None],
                        initial_state=state_BHKV, output_final_state=True, use_qk_l2norm_in_kernel=True)
    state_BHKV.copy_(final)
    return o[:, 0]


# ---- exact mode (numerics.exact, docs/exact.md): one form for prefill, decode and training ------
def exact_short_conv(window_TCK: torch.Tensor, weight_CK: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal conv given each output's window of ``K`` inputs (oldest first,
    zeros before a sequence's first input): a last-dim sum of ``K`` fp32 products per output, the
    same bits whether the window came from a prefill, a decode step's state or a packed row."""
    y = (window_TCK.float() * weight_CK.float()).contiguous().sum(-1)  # contiguous: K innermost, one reduction order
    return (y / (1.0 + torch.exp(-y))).to(window_TCK.dtype)


def exact_gated_delta_rule(
    q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor, g_BTH: torch.Tensor, beta_BTH: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in its recurrent form, one token at a time, for ``B`` sequences of ``T``
    new tokens (a shorter sequence padded at the end: its padding never reaches its real tokens):
    (``o_BTHV`` in v's dtype, the final states float32). Every product is a last-dim sum, so a
    token's output does not depend on ``B``, ``T`` or whether it came from a prefill, a decode step
    or a packed training row. Differentiable."""
    B, T, Hv, dv = v_BTHV.shape
    q, k, v, g, beta = _prepare(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, Hv)
    dk = q.shape[-1]
    S_BHVK = (torch.zeros(B, Hv, dv, dk, dtype=torch.float32, device=v.device) if state_BHKV is None
              else state_BHKV.float().transpose(-1, -2).contiguous())  # dk last and innermost: the sums run over it
    outs = []
    for t in range(T):
        S_BHVK = S_BHVK * torch.exp(g[:, t])[..., None, None]
        kS_BHV = (S_BHVK * k[:, t, :, None, :]).contiguous().sum(-1)
        u_BHV = beta[:, t, :, None] * (v[:, t] - kS_BHV)
        S_BHVK = S_BHVK + u_BHV[..., :, None] * k[:, t, :, None, :]
        outs.append((S_BHVK * q[:, t, :, None, :]).contiguous().sum(-1))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, Hv, dv)
    return o.to(v_BTHV.dtype), S_BHVK.transpose(-1, -2)
