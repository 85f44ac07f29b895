"""Token sampling from logits, returning the logprob of each sampled token under the processed
distribution (temperature, then top-k, then top-p, renormalised).

Shared by every in-process engine so all of them sample the same distribution. A draw takes one
uniform per row and inverts the row's CDF in two levels (:func:`inverse_cdf`): the chunk whose
cumulative mass first exceeds ``u * total``, then the token inside that chunk. On CUDA, when no
top-k/top-p filter is set, :func:`sample` runs the same two-level inversion as one fused Triton pass
over the logits (:mod:`tidal.engine.native.kernels.triton_sampling`) instead of materialising the
fp32 distribution; the distribution and the returned logprobs are the same, only the random stream
differs from the PyTorch path.

:func:`process_logits` is the one definition of the processed (target) distribution: speculative
decoding's acceptance test reads the same function.
"""

from __future__ import annotations

import torch

CHUNK = 1024  # tokens per chunk of the two-level CDF (the fused kernel splits a row into 16 chunks)


def process_logits(logits_BV: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Return fp32 log-probabilities of the processed distribution, -inf outside the kept set.

    temperature == 0 is treated as 1 for the logprobs (the caller takes the argmax).
    """
    logits_BV = logits_BV.float()
    if temperature > 0 and temperature != 1.0:
        logits_BV = logits_BV / temperature
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, idx_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (always keeps the first)
        drop_BV = (probs_BV.cumsum(-1) - probs_BV) >= top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        logits_BV = torch.full_like(logits_BV, float("-inf")).scatter(-1, idx_BV, sorted_BV)
    return logits_BV.log_softmax(-1)


def sample(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (token_B int64, logp_B fp32)."""
    if fused_applies(logits_BV.device, top_k, top_p):
        from tidal.engine.native.kernels.triton_sampling import fused_sample

        return fused_sample(logits_BV, temperature, generator)
    logp_BV = process_logits(logits_BV, temperature, top_k, top_p)
    if temperature == 0:
        token_B = logp_BV.argmax(-1)
    else:
        u_B = torch.rand(logp_BV.shape[0], device=logp_BV.device, generator=generator)
        token_B = inverse_cdf(logp_BV.exp(), u_B)
    return token_B, logp_BV.gather(-1, token_B[:, None]).squeeze(-1)


def inverse_cdf(p_BV: torch.Tensor, u_B: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The token of each row whose CDF interval holds ``u_B * total``: ``p_BV`` non-negative weights
    (unnormalised; each row with some positive weight), ``u_B`` uniforms in [0, 1). Two levels: the
    row's chunk sums of ``chunk`` tokens, then the tokens of the chosen chunk. Token i is drawn with
    probability ``p_i / total`` (up to float rounding of the sums); a token of zero weight never is."""
    B, V = p_BV.shape
    full, n = V // chunk, -(-V // chunk)
    mass_BN = p_BV.new_zeros(B, n)  # each chunk's mass (no padded copy of the row: it may be 100k+ wide)
    mass_BN[:, :full] = p_BV[:, : full * chunk].view(B, full, chunk).sum(-1)
    if n > full:
        mass_BN[:, full] = p_BV[:, full * chunk :].sum(-1)
    cdf_BN = monotone_cdf(mass_BN)
    target_B = u_B.to(cdf_BN.dtype) * cdf_BN[:, -1]
    c_B = search(cdf_BN, mass_BN > 0, target_B)
    before_B = torch.where(c_B > 0, cdf_BN.gather(-1, (c_B - 1).clamp_min(0)[:, None]).squeeze(-1), 0.0)
    idx_BC = c_B[:, None] * chunk + torch.arange(chunk, device=p_BV.device)
    p_BC = p_BV.gather(-1, idx_BC.clamp_max(V - 1)).masked_fill(idx_BC >= V, 0.0)  # the chosen chunk's weights
    i_B = search(monotone_cdf(p_BC), p_BC > 0, target_B - before_B)
    return c_B * chunk + i_B


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


def fused_applies(device: torch.device, top_k: int, top_p: float) -> bool:
    """Whether :func:`sample` takes the fused Triton pass (CUDA, no top-k/top-p filter)."""
    return device.type == "cuda" and top_k == 0 and top_p >= 1.0 and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
