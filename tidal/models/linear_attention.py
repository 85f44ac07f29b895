"""Packed (padding-free) training through Gated DeltaNet layers: the sequences of a packed row
(``cu_seqlens``, :mod:`tidal.models.varlen`) never mix, in the short convolution (it does not reach
back across a sequence start) nor in the delta rule (the state restarts at zero at each sequence
start), so a packed row computes exactly what each sequence computes alone.

Hugging Face's ``Qwen3_5GatedDeltaNet`` (and the layers built like it) reaches its kernels through
``transformers``' hub-kernel hook, which keeps packed sequences apart only with
flash-linear-attention installed and raises otherwise. :func:`enable_packed_linear_attention`
(called by :func:`~tidal.models.varlen.enable_packed_attention` for a family whose
``packed_kernels`` hold ``linear_attention``) gives each such layer of one model a packed forward
instead: the same projections, gates and norms (its own modules, so LoRA adapters on them take
part), with

- the causal depthwise conv computed over the packed row with each tap masked where it would read
  the previous sequence (:func:`varlen_causal_conv1d`);
- the delta rule per sequence (:func:`varlen_gated_delta_rule`): flash-linear-attention's varlen
  Triton kernel on CUDA when installed (the optional ``fla`` extra; not testable on CPU), else
  :func:`tidal.models.gated_delta_rule.chunk_gated_delta_rule` on each sequence alone.

A forward without ``cu_seq_lens_q`` (right- or left-padded rows, as HF runs them: padding zeroed
by the attention mask) runs the same kernels on every row at once; one with a cache (HF
``generate``) runs the layer's own HF forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tidal import exact
from tidal.models.gated_delta_rule import (
    chunk_gated_delta_rule,
    exact_gated_delta_rule,
    exact_short_conv,
    fla_available,
    fla_chunk_varlen,
)

_LAYER_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def is_gated_deltanet(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Gated DeltaNet layer laid out as HF's Qwen3.5 one."""
    return all(hasattr(module, part) for part in _LAYER_PARTS)


def enable_packed_linear_attention(decoder: torch.nn.Module) -> int:
    """Give every Gated DeltaNet layer of ``decoder`` (any module holding them: a decoder, a causal
    LM) the packed forward (this model only). Returns how many; ValueError when there is none (the
    family says it has them) or one whose conv activation is not SiLU."""
    layers = [m for m in decoder.modules() if is_gated_deltanet(m)]
    if not layers:
        raise ValueError(f"{type(decoder).__name__}: its family packs linear attention but it has no Gated DeltaNet layer")
    for layer in layers:
        if getattr(layer, "activation", "silu") != "silu":
            raise ValueError(f"{type(layer).__name__}: conv activation {layer.activation!r}; the packed forward has silu")
        if not hasattr(type(layer), "hf_class"):
            layer.__class__ = _packed_class(type(layer))
    return len(layers)


def _never(module) -> bool:
    return False


@functools.cache
def _packed_class(hf_class: type) -> type:
    """``hf_class`` with Tidal's forward. A subclass, not an instance attribute: ``transformers``
    re-kernelizes a model when it switches to training (``kernels`` installed), resetting each
    layer's forward to its class's; ``kernel_condition`` keeps ``kernels`` off these layers."""
    return type(f"Packed{hf_class.__name__}", (hf_class,), {
        "forward": packed_gated_deltanet_forward, "hf_class": hf_class, "kernel_condition": staticmethod(_never),
        "__module__": __name__,
    })


def packed_gated_deltanet_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                                  cu_seq_lens_q: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """HF ``Qwen3_5GatedDeltaNet.forward`` on one packed row ``[1, N, H]`` of the sequences
    ``cu_seq_lens_q``; the layer's own forward when not packed."""
    if cache is not None:
        if cu_seq_lens_q is not None:
            raise ValueError(f"{type(self).__name__}: a packed forward takes no cache")
        return self.hf_class.forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    B, T = hidden_states.shape[:2]
    if cu_seq_lens_q is None:  # B padded rows: each row is one sequence, its padding zeroed (HF's semantics)
        if attention_mask is not None and attention_mask.dim() == 2:
            hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
        cu_seq_lens_q = torch.arange(0, B * T + 1, T, device=hidden_states.device, dtype=torch.int32)
    elif B != 1:
        raise ValueError(f"{type(self).__name__}: a packed forward takes one packed row, got {B}")
    x_NH = hidden_states.reshape(B * T, -1)
    N = x_NH.shape[0]
    hk, dk = self.num_k_heads, self.head_k_dim
    hv, dv = self.num_v_heads, self.head_v_dim
    conv_NC = varlen_causal_conv1d(self.in_proj_qkv(x_NH), self.conv1d.weight[:, 0], cu_seq_lens_q)
    q, k, v = conv_NC.split([hk * dk, hk * dk, hv * dv], dim=-1)
    beta_NH = self.in_proj_b(x_NH).sigmoid()
    g_NH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_NH).float() + self.dt_bias)
    o_NHV = varlen_gated_delta_rule(q.view(N, hk, dk), k.view(N, hk, dk), v.view(N, hv, dv), g_NH, beta_NH,
                                    cu_seq_lens_q)
    z = self.in_proj_z(x_NH).reshape(N * hv, dv)
    o = self.norm(o_NHV.reshape(N * hv, dv), z).reshape(B, T, hv * dv)
    return self.out_proj(o)


def varlen_causal_conv1d(x_NC: torch.Tensor, weight_CK: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal conv of each packed sequence alone (zeros before its first
    input): ``y[t] = sum_j w[K-1-j] x[t-j]`` over the taps ``j`` that stay inside t's sequence."""
    N, K = x_NC.shape[0], weight_CK.shape[1]
    starts = cu_seqlens.to(torch.long)
    pos_N = torch.arange(N, device=x_NC.device) - torch.repeat_interleave(starts[:-1], starts.diff(), output_size=N)
    if exact.active():  # exact mode: each output from its window of K inputs, as the engine computes it
        taps = [F.pad(x_NC[: N - j], (0, 0, j, 0)) * (pos_N >= j)[:, None].to(x_NC.dtype) for j in range(K - 1, 0, -1)]
        return exact_short_conv(torch.stack(taps + [x_NC], dim=-1), weight_CK)
    w = weight_CK.to(x_NC.dtype)
    y = x_NC * w[:, K - 1]
    for j in range(1, K):
        shifted = F.pad(x_NC[:-j], (0, 0, j, 0)) * (pos_N >= j)[:, None].to(x_NC.dtype)
        y = y + shifted * w[:, K - 1 - j]
    return F.silu(y)


def varlen_gated_delta_rule(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The gated delta rule of each packed sequence from a zero state (shapes as
    :func:`~tidal.models.gated_delta_rule.chunk_gated_delta_rule` with N packed tokens)."""
    if q_NHK.is_cuda and fla_available() and not exact.active():  # pragma: no cover - CUDA with fla only
        return fla_chunk_varlen(q_NHK, k_NHK, v_NHV, g_NH, beta_NH, cu_seqlens.to(torch.long))[0]
    bounds = cu_seqlens.tolist()
    spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    L = max(e - s for s, e in spans)
    # each sequence alone, all at once: padded at the end to [S, L] (trailing zeros never reach a real token)
    padded = [torch.stack([F.pad(x[s:e], (0, 0) * (x.dim() - 1) + (0, L - (e - s))) for s, e in spans])
              for x in (q_NHK, k_NHK, v_NHV, g_NH, beta_NH)]
    # exact mode: the recurrent form the engine runs too (docs/exact.md)
    o_SLHV = exact_gated_delta_rule(*padded)[0] if exact.active() else batched_gated_delta_rule(*padded)
    return torch.cat([o_SLHV[i, : e - s] for i, (s, e) in enumerate(spans)])


def batched_gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH) -> torch.Tensor:
    """The gated delta rule of ``B`` sequences of ``T`` tokens each from zero states, in one
    chunked call (sequences are independent heads: ``B`` is folded into the head dimension)."""
    B, T = v_BTHV.shape[:2]

    def fold(x):
        return x.transpose(0, 1).reshape(T, B * x.shape[2], *x.shape[3:])

    o_TNV, _ = chunk_gated_delta_rule(*(fold(x) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)))
    return o_TNV.view(T, B, -1, o_TNV.shape[-1]).transpose(0, 1)
