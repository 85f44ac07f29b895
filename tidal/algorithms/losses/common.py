"""Shared pieces of the policy losses."""

from __future__ import annotations

from tidal.lazy import lazy_module

torch = lazy_module("torch")

# exp() of larger log-ratios overflows; such tokens are clipped (or weighted to 0) anyway.
LOG_RATIO_BOUND = 20.0


def log_ratio_BT(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token, bounded for a finite exp()."""
    return (logp_BT - old_logp_BT.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def weighted(loss_BT: torch.Tensor, weight_BT: torch.Tensor | None) -> torch.Tensor:
    return loss_BT if weight_BT is None else loss_BT * weight_BT.detach()


def approx_kl_BT(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_old || pi) per token from samples of pi_old: (r - 1) - log r."""
    lr = log_ratio.detach()
    return torch.exp(lr) - 1.0 - lr
