"""Token sampling from logits, returning the logprob of each sampled token under the processed
distribution (temperature, then top-k, then top-p, renormalised).

Shared by every in-process engine so all of them sample the same distribution. On CUDA, when no
top-k/top-p filter is set, :func:`sample` runs one fused Triton pass (temperature, log-sum-exp and a
Gumbel-max draw, one Philox call per four tokens) instead of materialising the fp32 distribution;
the distribution and the returned logprobs are the same, only the random stream differs from the
PyTorch path.
"""

from __future__ import annotations

import torch


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
        # Gumbel-max on the processed logprobs: exact sampling, one kernel, generator-controlled.
        u_BV = torch.rand(logp_BV.shape, device=logp_BV.device, generator=generator)
        gumbel_BV = -torch.log(-torch.log(u_BV.clamp_min(1e-20)))
        token_B = (logp_BV + gumbel_BV).argmax(-1)
    return token_B, logp_BV.gather(-1, token_B[:, None]).squeeze(-1)


def fused_applies(device: torch.device, top_k: int, top_p: float) -> bool:
    """Whether :func:`sample` takes the fused Triton pass (CUDA, no top-k/top-p filter)."""
    return device.type == "cuda" and top_k == 0 and top_p >= 1.0 and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
