"""The processed distribution: the one definition of what a rollout samples from and what the
trainer scores with (temperature, top-k, min-p, top-p, renormalised).

Both sides call this module, so they agree on the support, the tie rule and the renormalisation:
the native engine's sampler (:func:`tidal.engine.sampler.sample`, speculative acceptance, the
``hf`` backend) and the trainer's LM head (:mod:`tidal.models.lm_head`: old logprobs, the reference's
logprobs and the training forward's logprobs). With the same logits both give the same logprob of
a token up to the last fp32 bits (the same ops: ``z[token] - logsumexp(z)`` over the support).

The distribution of one row of logits ``l`` (``SamplingFilter`` ``f``):

1. ``z = l / T`` in fp32 (float64 for float64 logits); ``T = f.temperature`` (0, greedy, scores at 1).
2. The support is ``{v : z_v >= threshold}``, one threshold per row, the largest of:
   - top-k: the k-th largest ``z`` (every token tied with it is kept: more than k may stay);
   - min-p: ``max(z) + log(min_p)`` (``p_v >= min_p * p_max``; this commutes with top-k);
   - top-p, over what top-k and min-p kept, renormalised: in descending order, a token is kept
     while the mass strictly before it is below ``top_p`` (the token that crosses ``top_p`` stays);
     the threshold is the last kept token's ``z``, so tokens tied with it stay too.
   The rule is a threshold, so the support never depends on the order of tied logits. This is
   vLLM's order (temperature, min-p, then top-k and top-p) and its top-p boundary rule.
3. ``log p_v = z_v - logsumexp(z over the support)`` inside the support, ``-inf`` outside.

Scoring a token that was sampled (``labels_N`` given) the support also reaches down to that token:
``threshold = min(threshold, z[label])``. With the engine's own logits this changes nothing (a
sampled token is inside its support); with the trainer's logits, which round differently (bf16
engine, other kernels), a sampled token just outside the trainer's boundary keeps a finite logprob
instead of ``-inf`` (a NaN loss). The extension applies to exactly the row that needs it.

What it does not know: models, the LM head's chunking and autograd (:mod:`tidal.models.lm_head`
calls :func:`support_threshold` per chunk of rows and masks inside its compiled passes with
:func:`mask_outside`), random numbers and draws (:mod:`tidal.engine.sampler`).
"""

from __future__ import annotations

import dataclasses
import math

from tidal.config_base import check
from tidal.lazy import lazy_module

torch = lazy_module("torch")  # configs build a SamplingFilter before torch is needed

_SORT_ELEMENTS = 1 << 24  # logits sorted at once by the top-p threshold (rows x vocabulary): 64 MiB of fp32


@dataclasses.dataclass(kw_only=True, frozen=True)
class SamplingFilter:
    """The processed distribution's settings (``rollout.temperature/top_k/top_p/min_p``).

    temperature: ``z = logits / temperature``; 0 (greedy sampling) scores logprobs at 1.
    top_k: keep the k largest (and their ties); 0 disables.
    top_p: nucleus mass in (0, 1]; 1 disables.
    min_p: keep tokens with ``p >= min_p * p_max``, in [0, 1); 0 disables.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        check(self.temperature >= 0, "temperature", "must be >= 0")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(0 <= self.min_p < 1, "min_p", "must be in [0, 1) (0 disables)")

    @property
    def filters(self) -> bool:
        """Whether any filter (top-k, top-p, min-p) cuts the vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def scale(self) -> float:
        """The temperature the logits are divided by (1 for greedy)."""
        return self.temperature if self.temperature > 0 else 1.0


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the distribution's math for logits of ``dtype``: fp32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def tempered(logits_NV: torch.Tensor, f: SamplingFilter) -> torch.Tensor:
    """``z = logits / T`` in the math dtype (a new tensor)."""
    return logits_NV.to(math_dtype(logits_NV.dtype)) / f.scale


def mask_outside(z_NV: torch.Tensor, threshold_N: torch.Tensor | None) -> torch.Tensor:
    """``z`` with ``-inf`` outside the support ``z >= threshold`` (``threshold`` None: all of it)."""
    if threshold_N is None:
        return z_NV
    return z_NV.masked_fill(z_NV < threshold_N[:, None], float("-inf"))


def support_threshold(logits_NV: torch.Tensor, f: SamplingFilter, labels_N: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per row, the lowest tempered logit (:func:`tempered`) of the support (module docstring): the
    support is ``tempered(logits) >= threshold``. None when ``f`` filters nothing. ``labels_N``: the
    sampled tokens, which the support always keeps. Works on blocks of rows, so the extra memory
    is a block's tempered and sorted logits, never the whole ``[N, V]``."""
    if not f.filters:
        return None
    N, V = logits_NV.shape
    block = max(1, _SORT_ELEMENTS // max(V, 1))
    out_N = torch.empty(N, dtype=math_dtype(logits_NV.dtype), device=logits_NV.device)
    for s in range(0, N, block):
        e = min(s + block, N)
        out_N[s:e] = _block_threshold(tempered(logits_NV[s:e], f), f, None if labels_N is None else labels_N[s:e])
    return out_N


def _block_threshold(z_NV: torch.Tensor, f: SamplingFilter, labels_N: torch.Tensor | None) -> torch.Tensor:
    N, V = z_NV.shape
    thr_N = torch.full((N,), float("-inf"), dtype=z_NV.dtype, device=z_NV.device)
    if 0 < f.top_k < V:
        thr_N = torch.topk(z_NV, f.top_k, dim=-1).values[:, -1]
    if f.min_p > 0:
        thr_N = torch.maximum(thr_N, z_NV.amax(-1) + math.log(f.min_p))
    if f.top_p < 1.0:
        thr_N = torch.maximum(thr_N, _top_p_threshold(mask_outside(z_NV, thr_N), f.top_p))
    if labels_N is not None:
        thr_N = torch.minimum(thr_N, z_NV.gather(-1, labels_N[:, None]).squeeze(-1))
    return thr_N


def _top_p_threshold(z_NV: torch.Tensor, top_p: float) -> torch.Tensor:
    """The ``z`` of the last token kept by top-p over the (already cut, ``-inf``) row: in descending
    order, tokens are kept while the renormalised mass strictly before them is below ``top_p``."""
    sorted_NV = torch.sort(z_NV, dim=-1, descending=True).values
    p_NV = sorted_NV.softmax(-1)
    before_NV = p_NV.cumsum(-1) - p_NV
    finite_N = (sorted_NV > float("-inf")).sum(-1)
    # at least the first token; never past the kept tokens (the sums may round below top_p there)
    keep_N = torch.minimum((before_NV < top_p).sum(-1), finite_N).clamp_min(1)
    return sorted_NV.gather(-1, (keep_N - 1)[:, None]).squeeze(-1)


def processed_logits(logits_NV: torch.Tensor, f: SamplingFilter, labels_N: torch.Tensor | None = None) -> torch.Tensor:
    """``z`` of the processed distribution: tempered logits (math dtype), ``-inf`` outside the support."""
    return mask_outside(tempered(logits_NV, f), support_threshold(logits_NV, f, labels_N))


def processed_logprobs(logits_NV: torch.Tensor, f: SamplingFilter) -> torch.Tensor:
    """Log-probabilities ``[N, V]`` of the processed distribution (``-inf`` outside the support)."""
    z_NV = processed_logits(logits_NV, f)
    return z_NV - torch.logsumexp(z_NV, dim=-1, keepdim=True)
