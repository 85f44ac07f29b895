"""Token sampling from logits, returning the logprob of each sampled token under the processed
distribution (temperature, top-k, min-p, top-p, renormalised: :mod:`tidal.sampling_filter`, the one
definition the trainer scores with too).

Shared by every in-process engine so all of them sample the same distribution. A draw takes one
uniform per row and inverts the row's CDF in two levels (:func:`inverse_cdf`): the chunk whose
cumulative mass first exceeds ``u * total``, then the token inside that chunk. On CUDA, when no
top-k/top-p/min-p filter is set, :func:`sample` runs the same two-level inversion as one fused Triton pass
over the logits (:mod:`tidal.engine.native.kernels.triton_sampling`) instead of materialising the
fp32 distribution; it reads the same uniforms, so the distribution, the returned logprobs and the
draws are the same (up to the float rounding of the sums at an interval's edge).

Batch-invariant randomness (:func:`keyed_uniforms`): the uniform of a sampled token is a function of
(seed, request key, position) only, a counter-based generator (SplitMix64: the request's stream
state from its seed and key, the token's position as the counter), never of which sequences share
the step or in which order they were added. So a sequence samples the same tokens alone or in any
batch (given the same logits: batched matmuls may round logits differently, which moves a draw only
when its uniform falls within that rounding of an interval's edge), a preempted or resumed sequence
draws again what it drew, and a request that continues a sequence under the same key and seed (a
multi-turn trajectory's next turn: its positions go on) continues its stream. An engine's request
key is :func:`request_key` of the request's ``key`` (by default its id; callers give a sequence's
:func:`tidal.engine.base.sequence_key`).

:func:`process_logits` is the processed (target) distribution of :mod:`tidal.sampling_filter` with
the engine's arguments: speculative decoding's acceptance test reads the same function.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from tidal.sampling_filter import SamplingFilter, processed_logits, processed_logprobs

CHUNK = 1024  # tokens per chunk of the two-level CDF (the fused kernel splits a row into 16 chunks)


NO_TOKEN = -2  # the sample of a row without a token of positive probability (non-finite logits)


def process_logits(logits_BV: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> torch.Tensor:
    """Log-probabilities of the processed distribution, ``-inf`` outside its support:
    :func:`tidal.sampling_filter.processed_logprobs` (fp32; float64 for float64 logits).
    temperature == 0 is treated as 1 for the logprobs (the caller takes the argmax)."""
    return processed_logprobs(logits_BV, SamplingFilter(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))


def sample(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    u_B: torch.Tensor | None = None,
    min_p: float = 0.0,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: row b takes the token whose CDF interval holds ``u_B[b]`` (fp32
    uniforms in [0, 1) on the logits' device, e.g. :func:`keyed_uniforms`; unused, and may be None,
    when ``temperature == 0``: the argmax). Returns (token_B int64, logp_B fp32): the logprob is
    ``z[token] - logsumexp(z)`` over the support (:mod:`tidal.sampling_filter`), the trainer's formula.
    A row of non-finite logits samples :data:`NO_TOKEN` with a NaN logprob. ``fused`` False: never
    the fused Triton pass (exact mode returns that formula's bits)."""
    if temperature > 0 and (u_B is None or u_B.shape != logits_BV.shape[:1]):
        raise ValueError(f"sample: temperature {temperature} needs one uniform per row ({logits_BV.shape[0]}), got "
                         f"{None if u_B is None else tuple(u_B.shape)}")
    f = SamplingFilter(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    if fused and fused_applies(logits_BV.device, f):
        from tidal.engine.native.kernels.triton_sampling import fused_sample

        return fused_sample(logits_BV, temperature, u_B)
    z_BV = processed_logits(logits_BV, f)
    logz_B = torch.logsumexp(z_BV, dim=-1)
    if temperature == 0:
        token_B = z_BV.argmax(-1)
    else:
        token_B = inverse_cdf(torch.exp(z_BV - logz_B[:, None]), u_B)
    # NO_TOKEN: a row without a token of positive probability (non-finite logits); its logprob is NaN
    logp_B = z_BV.gather(-1, token_B.clamp_min(0)[:, None]).squeeze(-1) - logz_B
    return torch.where(token_B < 0, NO_TOKEN, token_B), torch.where(token_B < 0, float("nan"), logp_B)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2**64 / golden ratio, odd)
_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Stafford's Mix13): a bijection of uint64 with full avalanche."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keyed_uniforms(seed_B, key_B, pos_B) -> np.ndarray:
    """The uniform (fp32 in [0, 1), a multiple of 2**-24) of the token at position ``pos_B`` (its
    index in the sequence, prompt included) of the request ``key_B`` sampled with ``seed_B``; all
    three uint64-like arrays (or scalars) of one shape. Counter-based: SplitMix64 (Steele, Lea and
    Flood, 2014) with stream state ``mix(mix(seed + golden) ^ key)`` and counter ``pos + 1``, so the
    value depends on nothing else (not the batch, not the order of calls)."""
    seed_B, key_B, pos_B = (np.asarray(a).astype(np.uint64) for a in (seed_B, key_B, pos_B))
    with np.errstate(over="ignore"):
        state_B = _mix64(_mix64(seed_B + _GOLDEN) ^ key_B)
        z_B = _mix64(state_B + (pos_B + np.uint64(1)) * _GOLDEN)
    return (z_B >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def request_key(request_id: int | str) -> int:
    """The key of a request's random stream (:func:`keyed_uniforms`): an int id itself (mod 2**64),
    a str id its BLAKE2b digest (stable across processes, unlike ``hash``)."""
    if isinstance(request_id, str):
        return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return int(request_id) & _MASK64


def inverse_cdf(p_BV: torch.Tensor, u_B: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The token of each row whose CDF interval holds ``u_B * total``: ``p_BV`` non-negative weights
    (unnormalised; each row with some positive weight), ``u_B`` uniforms in [0, 1). Two levels: the
    row's chunk sums of ``chunk`` tokens, then the tokens of the chosen chunk. Token i is drawn with
    probability ``p_i / total`` (up to float rounding of the sums); a token of zero weight never is.
    A row of no positive weight (NaN logits upstream) gets -1, never an index outside the row."""
    B, V = p_BV.shape
    full, n = V // chunk, -(-V // chunk)
    mass_BN = p_BV.new_zeros(B, n)  # each chunk's mass (no padded copy of the row: it may be 100k+ wide)
    mass_BN[:, :full] = p_BV[:, : full * chunk].view(B, full, chunk).sum(-1)
    if n > full:
        mass_BN[:, full] = p_BV[:, full * chunk :].sum(-1)
    cdf_BN = monotone_cdf(mass_BN)
    target_B = u_B.to(cdf_BN.dtype) * cdf_BN[:, -1]
    found_B = search(cdf_BN, mass_BN > 0, target_B)
    c_B = found_B.clamp_min(0)  # a row without positive weight (non-finite logits) reads chunk 0, and returns -1
    before_B = torch.where(c_B > 0, cdf_BN.gather(-1, (c_B - 1).clamp_min(0)[:, None]).squeeze(-1), 0.0)
    idx_BC = c_B[:, None] * chunk + torch.arange(chunk, device=p_BV.device)
    p_BC = p_BV.gather(-1, idx_BC.clamp_max(V - 1)).masked_fill(idx_BC >= V, 0.0)  # the chosen chunk's weights
    i_B = search(monotone_cdf(p_BC), p_BC > 0, target_B - before_B)
    return torch.where(found_B < 0, -1, c_B * chunk + i_B)


def monotone_cdf(w_BK: torch.Tensor) -> torch.Tensor:
    """Prefix sums of the non-negative ``w_BK`` made non-decreasing (a parallel scan may round a
    later sum below an earlier one) and flat over zero weights: the sum can rise only at an element
    of positive weight, so only such an element is ever the first to exceed a target."""
    cdf_BK = w_BK.cumsum(-1).masked_fill(w_BK <= 0, 0.0)
    return torch.cummax(cdf_BK, -1).values


def search(cdf_BK: torch.Tensor, positive_BK: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    """The first index of each row whose (monotone) ``cdf_BK`` exceeds ``target_B``; when none does
    (``target`` rounded to the total or above), the last element of positive weight."""
    i_B = torch.searchsorted(cdf_BK, target_B[:, None].contiguous(), right=True).squeeze(-1)
    k = torch.arange(cdf_BK.shape[-1], device=cdf_BK.device)
    last_B = torch.where(positive_BK, k, -1).amax(-1)
    return torch.minimum(i_B, last_B)


def fused_applies(device: torch.device, f: SamplingFilter) -> bool:
    """Whether :func:`sample` takes the fused Triton pass (CUDA, no top-k/top-p/min-p filter)."""
    return device.type == "cuda" and not f.filters and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
