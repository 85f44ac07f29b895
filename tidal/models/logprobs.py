"""Token log-probabilities and entropies of a causal LM, temperature-aware and chunked.

Layout: ``logp_BT[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` under ``softmax(logits / T)``;
position 0 has no prediction and is 0. The full-vocabulary fp32 logits are never materialised for
the whole batch: the LM head runs over chunks of hidden states, and under autograd each chunk is
recomputed in the backward pass (activation checkpointing), so peak extra memory is one chunk.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGPROB_METHOD = "tidal_token_logprobs"


def _chunk_logp_entropy(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, labels_N: torch.Tensor,
    temperature: float, with_entropy: bool, entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NV = F.linear(hidden_NH, weight_VH, bias_V).float()
    if temperature != 1.0:
        logits_NV = logits_NV / temperature
    logz_N = torch.logsumexp(logits_NV, dim=-1)
    logp_N = logits_NV.gather(-1, labels_N[:, None]).squeeze(-1) - logz_N
    if with_entropy:
        # H = logZ - sum p * logits; without entropy_grad no graph is kept (a metric, or a mask)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs_NV = torch.exp(logits_NV - logz_N[:, None])
            entropy_N = logz_N - (probs_NV * logits_NV).sum(-1)
    else:
        entropy_N = torch.zeros_like(logp_N)
    return logp_N, entropy_N


def lm_head_logprobs(
    hidden_BTH: torch.Tensor,
    lm_head: torch.nn.Linear,
    input_ids_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 2048,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the next tokens from decoder hidden states.

    hidden_BTH[b, t] predicts input_ids[b, t+1]. Returns tensors [B, T] aligned with input_ids.
    ``entropy_grad=False``: the entropies carry no gradient (same values; no backward through the
    full-vocabulary softmax for them), for when they are only a metric or a token mask.
    """
    B, T, H = hidden_BTH.shape
    hidden_NH = hidden_BTH[:, :-1].reshape(-1, H)
    labels_N = input_ids_BT[:, 1:].reshape(-1)
    weight, bias = lm_head.weight, lm_head.bias
    logps, ents = [], []
    use_ckpt = torch.is_grad_enabled() and hidden_NH.requires_grad
    for s in range(0, hidden_NH.shape[0], chunk_tokens):
        args = (hidden_NH[s : s + chunk_tokens], weight, bias, labels_N[s : s + chunk_tokens], temperature, with_entropy,
                entropy_grad)
        if use_ckpt:
            lp, en = checkpoint(_chunk_logp_entropy, *args, use_reentrant=False)
        else:
            lp, en = _chunk_logp_entropy(*args)
        logps.append(lp)
        ents.append(en)
    zeros_B1 = hidden_BTH.new_zeros(B, 1, dtype=torch.float32)
    logp_BT = torch.cat([zeros_B1, torch.cat(logps).view(B, T - 1)], dim=1)
    entropy_BT = torch.cat([zeros_B1, torch.cat(ents).view(B, T - 1)], dim=1) if with_entropy else None
    return logp_BT, entropy_BT


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
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 2048,
    mm_inputs: dict | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden_BTH = body_hidden_states(hf_model, input_ids_BT, attention_mask_BT, mm_inputs)
    return lm_head_logprobs(
        hidden_BTH, hf_model.get_output_embeddings(), input_ids_BT,
        temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad,
    )


def attach_logprob_method(model: torch.nn.Module, hf_model: torch.nn.Module | None = None) -> None:
    """Give ``model`` a ``tidal_token_logprobs(input_ids, attention_mask, ...)`` method computed
    with the HF causal LM ``hf_model`` (default: ``model`` itself; a wrapper such as a PEFT model
    passes the HF model it wraps).

    It is a method of the model itself (not a wrapper module) so parameter names stay the HF names;
    FSDP2 strategies register it with ``register_fsdp_forward_method`` on ``model`` (the sharded
    root) so it unshards like forward.
    """
    target = model if hf_model is None else hf_model
    setattr(model, LOGPROB_METHOD, functools.partial(_token_logprobs, target))


def token_logprobs(model, input_ids_BT, attention_mask_BT, *, temperature=1.0, with_entropy=False, chunk_tokens=2048, mm_inputs=None,
                   entropy_grad=True):
    """Call the model's attached logprob method (see :func:`attach_logprob_method`). ``mm_inputs``:
    the batch's collated multimodal inputs (:func:`tidal.models.vision.collate_mm_inputs`), or
    None/{} for text. ``entropy_grad``: see :func:`lm_head_logprobs`."""
    return getattr(model, LOGPROB_METHOD)(input_ids_BT, attention_mask_BT, temperature, with_entropy, chunk_tokens, mm_inputs or None,
                                          entropy_grad)


def reference_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Plain full-logits reference (for tests): same layout as :func:`lm_head_logprobs`."""
    logp_BTV = (logits_BTV.float() / temperature).log_softmax(-1)
    logp = logp_BTV[:, :-1].gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
