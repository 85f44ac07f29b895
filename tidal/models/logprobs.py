"""Token log-probabilities and entropies of a causal LM: the body's hidden states (padded, or
packed: :mod:`tidal.models.packing`) through the chunked LM head (:mod:`tidal.models.lm_head`).

Layout: ``logp_BT[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` under the processed
distribution of a :class:`~tidal.sampling_filter.SamplingFilter` (temperature, top-k, min-p, top-p:
the distribution the engine samples from); position 0 has no prediction and is 0. A model gets the computation as a method of its own
(:func:`attach_logprob_method`), whose LM-head compile flag is bound per model
(:func:`set_head_compile`, set by the strategy that prepares it).
"""

from __future__ import annotations

import functools

import torch

from tidal.exact import exact_numerics
from tidal.models.lm_head import lm_head_logprobs
from tidal.models.packing import pack_on_the_fly, packed_token_logprobs
from tidal.models.varlen import uses_packed_attention
from tidal.sampling_filter import SamplingFilter

LOGPROB_METHOD = "tidal_token_logprobs"

def body_hidden_states(
    hf_model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, mm_inputs: dict | None = None
) -> torch.Tensor:
    """Last hidden states [B, T, H] of an HF causal LM's body (no LM head).

    Text: the decoder with positions counted from the attention mask (any padding side); on a VL
    model the vision tower also runs on a blank image, contributing 0 (keeps sharded ranks in step).
    ``mm_inputs`` (``pixel_values``, ``image_grid_thw`` of the batch's images, row order): the
    multimodal body (vision tower + decoder) with the model's multimodal (M-RoPE) positions.
    """
    if mm_inputs:
        from tidal.models.vision import multimodal_body_inputs

        return hf_model.model(**multimodal_body_inputs(hf_model, input_ids_BT, attention_mask_BT, mm_inputs), use_cache=False).last_hidden_state
    zero = None
    if getattr(hf_model.config, "vision_config", None) is not None:  # text batch, VL model: see vision_keepalive
        from tidal.models.vision import vision_keepalive

        zero = vision_keepalive(hf_model, hf_model.get_input_embeddings().weight)  # tower first, as with images
    position_ids = (attention_mask_BT.long().cumsum(-1) - 1).clamp_min(0)
    out = hf_model.get_decoder()(input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if zero is None else out.last_hidden_state + zero


def _token_logprobs(
    hf_model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    sampling: SamplingFilter = SamplingFilter(),
    with_entropy: bool = False,
    chunk_tokens: int = 2048,
    mm_inputs: dict | None = None,
    entropy_grad: bool = True,
    positions_BT: torch.Tensor | None = None,
    packed=None,
    *,
    compile_head: bool = True,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attached method (see :func:`attach_logprob_method`). Its parameters are positional in
    this order, the order :func:`token_logprobs` passes them in (wrappers forward ``*args``);
    ``compile_head`` and ``exact`` are bound with the method (:func:`set_head_compile`,
    :func:`set_exact`)."""
    if exact:
        if packed is None and not uses_packed_attention(hf_model):
            raise RuntimeError("exact mode runs packed forwards only (tidal.models.varlen.enable_packed_attention)")
        with exact_numerics():
            return _token_logprobs(hf_model, input_ids_BT, attention_mask_BT, sampling, with_entropy, chunk_tokens, mm_inputs,
                                   entropy_grad, positions_BT, packed, compile_head=False)
    if packed is None and uses_packed_attention(hf_model):
        packed, positions_BT = pack_on_the_fly(input_ids_BT, attention_mask_BT, positions_BT), None
    if packed is not None:
        if positions_BT is not None:
            raise ValueError("with packed=, the positions are the packed batch's targets (PackedBatch.build(targets_BT=...)); pass positions_BT=None")
        return packed_token_logprobs(
            hf_model, packed, input_ids_BT, attention_mask_BT, sampling=sampling, with_entropy=with_entropy,
            chunk_tokens=chunk_tokens, mm_inputs=mm_inputs, entropy_grad=entropy_grad, compile_head=compile_head,
        )
    hidden_BTH = body_hidden_states(hf_model, input_ids_BT, attention_mask_BT, mm_inputs)
    return lm_head_logprobs(
        hidden_BTH, hf_model.get_output_embeddings(), input_ids_BT,
        sampling=sampling, with_entropy=with_entropy, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad,
        positions_BT=positions_BT, compile_head=compile_head,
    )


def attach_logprob_method(model: torch.nn.Module, hf_model: torch.nn.Module | None = None, *, compile_head: bool = True) -> None:
    """Give ``model`` a ``tidal_token_logprobs(input_ids, attention_mask, ...)`` method computed
    with the HF causal LM ``hf_model`` (default: ``model`` itself; a wrapper such as a PEFT model
    passes the HF model it wraps).

    It is a method of the model itself (not a wrapper module) so parameter names stay the HF names;
    FSDP2 strategies register it with ``register_fsdp_forward_method`` on ``model`` (the sharded
    root) so it unshards like forward. ``compile_head``: see :func:`set_head_compile`.
    """
    target = model if hf_model is None else hf_model
    setattr(model, LOGPROB_METHOD, functools.partial(_token_logprobs, target, compile_head=compile_head))


def set_exact(model: torch.nn.Module, enabled: bool) -> None:
    """Whether ``model``'s attached logprob method runs in exact mode (``numerics.exact``,
    docs/exact.md): its whole forward under :func:`tidal.exact.exact_numerics`, so its logprobs are
    the native engine's bit for bit. Set it before a strategy wraps the method (as
    :func:`set_head_compile`). On: an MoE model's experts run ``transformers``' eager loop (one
    ``F.linear`` per expert over its tokens, summed per token in expert order, as the native
    engine's experts do) instead of its grouped GEMM."""
    _rebind(model, exact=bool(enabled))
    method = getattr(model, LOGPROB_METHOD, None)
    if enabled and method is not None:
        for module in method.args[0].modules():
            config = getattr(module, "config", None)
            if getattr(config, "_experts_implementation", None) not in (None, "eager"):
                config._experts_implementation = "eager"


def set_head_compile(model: torch.nn.Module, enabled: bool) -> None:
    """Whether ``model``'s attached logprob method runs its LM-head passes compiled on CUDA (default
    on): the strategy that prepares the model sets it from ``strategy.compile``, before it wraps the
    method; it holds for this model only. A model without the method is left as it is."""
    _rebind(model, compile_head=bool(enabled))


def _rebind(model: torch.nn.Module, **keywords) -> None:
    """Re-bind keywords of ``model``'s attached logprob method (none attached: nothing to do)."""
    method = getattr(model, LOGPROB_METHOD, None)
    if method is None:
        return
    if not isinstance(method, functools.partial) or method.func is not _token_logprobs:
        raise TypeError(f"{', '.join(keywords)}: {type(model).__name__}.{LOGPROB_METHOD} is already wrapped; set it before "
                        f"the strategy wraps the method")
    setattr(model, LOGPROB_METHOD, functools.partial(_token_logprobs, *method.args, **{**method.keywords, **keywords}))


def token_logprobs(model, input_ids_BT, attention_mask_BT, *, sampling=SamplingFilter(), with_entropy=False, chunk_tokens=2048,
                   mm_inputs=None, entropy_grad=True, positions_BT=None, packed=None):
    """Call the model's attached logprob method (see :func:`attach_logprob_method`). ``sampling``: the
    processed distribution scored (:class:`~tidal.sampling_filter.SamplingFilter`; a training run passes
    ``rollout.filter``, the one its engine sampled from; default: temperature 1, no filter). ``mm_inputs``:
    the batch's collated multimodal inputs (:func:`tidal.models.vision.collate_mm_inputs`), or
    None/{} for text. ``entropy_grad``, ``positions_BT``: see :func:`lm_head_logprobs`.

    ``packed``: the :class:`~tidal.models.packing.PackedBatch` of these right-padded rows (on the
    model's device): the forward runs padding-free on it (the model must have been switched with
    :func:`tidal.models.varlen.enable_packed_attention`) and the results come back in the same
    [B, T] layout, non-zero only at the packed batch's targets (``positions_BT`` must be None).
    A model switched to packed attention packs a call without ``packed`` itself (the targets are
    ``positions_BT``; a host synchronisation to build the layout): same results, zero off the targets."""
    return getattr(model, LOGPROB_METHOD)(input_ids_BT, attention_mask_BT, sampling, with_entropy, chunk_tokens, mm_inputs or None,
                                          entropy_grad, positions_BT, packed)
