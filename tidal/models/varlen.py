"""Attention over packed sequences: S sequences laid end to end in one row of N tokens, delimited by
``cu_seqlens`` (int32 ``[S + 1]``, ``cu_seqlens[s]`` = first token of sequence s, ``cu_seqlens[S] = N``).
Token i attends to token j only when both are in the same sequence (and j <= i when causal), so a
packed row computes exactly what each sequence would alone. A sliding-window layer (HF's
``sliding_window`` W, Gemma 3 / OLMo 3) also needs ``i - j < W``: within one sequence that is its
own window, and the sequence mask keeps it from ever reaching across a ``cu_seqlens`` boundary.

Two kernels, one contract (:func:`varlen_attention`):

- **flash** (CUDA, bf16/fp16, head dim <= 256 and a multiple of 8): PyTorch's own FlashAttention-2
  varlen kernel through ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; forward, backward
  and ``torch.compile`` support come with it; no flash-attn package). Work is the sum of the
  sequences' causal triangles, never N^2. Grouped-query attention runs natively (no K/V copies).
  Needs an Ampere or newer GPU (sm80+): an older one gets PyTorch's error from the kernel.
- **reference** (everything else: CPU, fp32): one ``scaled_dot_product_attention`` call with a
  block-diagonal (causal) boolean mask built from ``cu_seqlens``. It holds an ``[N, N]`` mask, so it
  is meant for tests and small CPU runs; the GPU path never uses it in bf16.

Hugging Face models reach it through the attention-function registry: :func:`enable_packed_attention`
switches a model's decoder to :data:`PACKED_ATTENTION`, after which its decoder layers expect the
packed keyword arguments of :func:`packed_attention_kwargs` (``cu_seq_lens_q/k``,
``max_length_q/k``: the names ``transformers`` passes through ``TransformersKwargs`` down to the
attention function) on every forward, with ``attention_mask=None`` and position ids restarted per
sequence. No mask function is registered for it, so ``transformers`` builds no ``[N, N]`` mask.
A causal forward without those arguments is an error (it would attend across sequences; Tidal's
``token_logprobs`` / ``critic_values`` pack such calls themselves); a non-causal module sharing the
config falls back to SDPA unchanged.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F

from tidal import exact, families
from tidal.models.linear_attention import enable_packed_linear_attention

PACKED_ATTENTION = "tidal_varlen"

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()

# a build-time property of this torch (no CUDA initialisation)
_FLASH_BUILT = _varlen_attn is not None and torch.backends.cuda.is_flash_attention_available()


def packed_attention_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """The keyword arguments a packed forward passes to an HF model (they reach the attention function)."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen, "max_length_k": max_seqlen}


def uses_flash(q_NHD: torch.Tensor) -> bool:
    """Whether :func:`varlen_attention` runs the flash kernel for queries like ``q_NHD``."""
    D = q_NHD.shape[-1]
    return _FLASH_BUILT and q_NHD.is_cuda and q_NHD.dtype in (torch.bfloat16, torch.float16) and D <= 256 and D % 8 == 0


def varlen_attention(
    q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    *, causal: bool = True, scale: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """Attention of packed sequences: ``out_NHD[i] = softmax(scale * q_i K_s^T) V_s`` over the keys
    ``K_s`` of token i's sequence s (those at or before i when ``causal``; with ``window`` W only
    those with ``i - j < W``, HF's ``sliding_window``). ``q_NHD``: [N, H, D]; ``k_NKD``/``v_NKD``:
    [N, K, D] with K dividing H (grouped-query attention); ``cu_seqlens``: int32 [S + 1] on the same
    device, ``max_seqlen`` the longest sequence. ``scale`` None: ``D ** -0.5``. Returns [N, H, D] in
    the inputs' dtype."""
    if window is not None and not causal:
        raise NotImplementedError("a sliding window over bidirectional attention is not supported in packed forwards")
    if exact.active():  # exact mode (docs/exact.md): the attention the native engine runs too
        if not causal:
            raise NotImplementedError("exact mode covers causal attention only")
        return exact.varlen_attention(q_NHD, k_NKD, v_NKD, cu_seqlens, scale, window)
    if uses_flash(q_NHD):
        return _flash(q_NHD, k_NKD, v_NKD, cu_seqlens, max_seqlen, causal, scale, window)
    return reference_varlen_attention(q_NHD, k_NKD, v_NKD, cu_seqlens, causal=causal, scale=scale, window=window)


def _flash(q_NHD, k_NKD, v_NKD, cu_seqlens, max_seqlen, causal, scale, window=None):
    """``varlen_attn`` across its signatures: torch 2.10 takes ``is_causal``; later versions a
    ``window_size`` ((-1, 0) is causal; ``(W - 1, 0)`` a sliding window of W: keys ``i - (W-1) <= j
    <= i``) and ``scale``; 2.12+ an ``enable_gqa`` flag (earlier ones pass K < H heads to the kernel,
    which groups them natively)."""
    kw = {}
    if "window_size" in _VARLEN_PARAMS:
        kw["window_size"] = (-1, -1) if not causal else (-1, 0) if window is None else (window - 1, 0)
    elif window is not None:
        raise NotImplementedError("this torch's varlen_attn has no window_size: sliding-window packed attention needs torch >= 2.11")
    else:
        kw["is_causal"] = causal
    if "scale" in _VARLEN_PARAMS:
        kw["scale"] = scale
    elif scale is not None and abs(scale - q_NHD.shape[-1] ** -0.5) > 1e-9 * scale:
        raise NotImplementedError(f"this torch's varlen_attn has no scale argument; attention scale {scale} is not 1/sqrt(head_dim)")
    if "enable_gqa" in _VARLEN_PARAMS and k_NKD.shape[1] != q_NHD.shape[1]:
        kw["enable_gqa"] = True
    # the kernel reads rows with a unit stride in D; HF's layout already is [N, H, D] in memory (a
    # no-op then), a compiled layer may hand over another one
    q_NHD, k_NKD, v_NKD = q_NHD.contiguous(), k_NKD.contiguous(), v_NKD.contiguous()
    return _varlen_attn(q_NHD, k_NKD, v_NKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)


def sequence_ids(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """``seq_N[i]`` = the sequence token i belongs to (traceable: no host reads; ``cu_seqlens`` is
    used whole, since a slice of a one-sequence batch would have size 1, which ``torch.compile``
    specialises, recompiling for the next batch)."""
    return torch.searchsorted(cu_seqlens.to(torch.long), torch.arange(n, device=cu_seqlens.device), right=True) - 1


def reference_varlen_attention(
    q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor, cu_seqlens: torch.Tensor,
    *, causal: bool = True, scale: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """The contract of :func:`varlen_attention` as one SDPA call with a block-diagonal mask (any
    device and dtype; ``[N, N]`` booleans of memory)."""
    N = q_NHD.shape[0]
    seq_N = sequence_ids(cu_seqlens, N)
    allowed_NN = seq_N[:, None] == seq_N[None, :]
    if causal:
        pos_N = torch.arange(N, device=q_NHD.device)
        allowed_NN = allowed_NN & (pos_N[None, :] <= pos_N[:, None])
        if window is not None:  # i - j < W; the same-sequence mask keeps it inside the sequence
            allowed_NN = allowed_NN & (pos_N[None, :] > pos_N[:, None] - window)
    out_1HND = F.scaled_dot_product_attention(
        q_NHD.transpose(0, 1)[None], k_NKD.transpose(0, 1)[None], v_NKD.transpose(0, 1)[None],
        attn_mask=allowed_NN[None, None], scale=scale, enable_gqa=True,  # a no-op with as many K/V heads as queries
    )
    return out_1HND[0].transpose(0, 1)


def packed_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    sliding_window: int | None = None, cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
    is_causal: bool | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`PACKED_ATTENTION` (HF's calling convention:
    ``query`` [1, H, N, D], ``key``/``value`` [1, K, N, D]; returns ``([1, N, H, D], None)``).
    ``attention_mask`` is ignored: the sequences are ``cu_seq_lens_q``. Keys are the queries'
    tokens (self-attention), so ``cu_seq_lens_k`` / ``max_length_k`` (in ``kwargs``) are the same."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if cu_seq_lens_q is None:
        if causal:
            raise RuntimeError(
                f"{type(module).__name__}: this model runs packed forwards only (enable_packed_attention); "
                "call it through tidal.models.packing (cu_seq_lens_q / max_length_q are missing)"
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if dropout:
        raise NotImplementedError(f"packed attention has no attention dropout ({type(module).__name__} asks for {dropout}); set the model's attention_dropout to 0")
    out_NHD = varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                               cu_seq_lens_q, max_length_q, causal=causal, scale=scaling, window=sliding_window)
    return out_NHD[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    return hf.get_decoder() if hasattr(hf, "get_decoder") else getattr(hf, getattr(hf, "base_model_prefix", ""), None)


def enable_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch the decoder of an HF causal LM, a VL model or a token-classification head (a critic) --
    or the HF model a PEFT wrapper holds -- to :data:`PACKED_ATTENTION`. From then on every forward
    of its decoder must be packed (:mod:`tidal.models.packing`); a vision tower keeps its own
    attention. Returns ``model``.

    A family whose ``packed_kernels`` hold ``linear_attention`` (Qwen3.5) also gets its Gated
    DeltaNet layers' packed forward (:mod:`tidal.models.linear_attention`: the state restarts at
    each sequence). Only this model changes: its decoder gets its own copy of the config with the new attention
    (every module of the decoder that held the shared config is pointed at the copy), so a model
    built later from ``model.config`` (e.g. an HF rollout engine) keeps the attention it had."""
    _register()
    decoder = _decoder(model)
    shared = decoder.config
    own = copy.copy(shared)
    own._attn_implementation = PACKED_ATTENTION
    for module in decoder.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
    family = families.find_family(shared)
    if family is not None and "linear_attention" in family.packed_kernels:
        enable_packed_linear_attention(decoder)
    return model


def uses_packed_attention(model: torch.nn.Module) -> bool:
    """Whether :func:`enable_packed_attention` switched ``model``'s decoder."""
    return getattr(getattr(_decoder(model), "config", None), "_attn_implementation", None) == PACKED_ATTENTION
