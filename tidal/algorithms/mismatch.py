"""Rollout/trainer mismatch: metrics and truncated importance sampling.

The engine samples with pi_rollout (its own kernels, maybe lower precision); the loss treats the
trainer's pi_old as the behaviour policy. rho = pi_old / pi_rollout corrects the difference
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"):
    token_truncate: w_t = min(rho_t, C)                       (TIS)
    token_mask:     w_t = rho_t if lower <= rho_t <= C else 0 (masked IS)
    seq_truncate / seq_mask: the same with rho_i = prod_t rho_t, given to every token of i.
Metrics (every step, whatever the mode): mismatch_kl = k3 estimate of KL(pi_rollout || pi_old),
mismatch_abs_logp_diff = mean |log pi_old - log pi_rollout|, mismatch_is_weight = mean applied
weight, mismatch_corrected_frac = fraction of response tokens truncated or masked (in the
sequence modes: tokens of sequences whose ratio was truncated or masked).
"""

from __future__ import annotations

from tidal.algorithms.aggregation import token_mean_metric
from tidal.lazy import lazy_module

torch = lazy_module("torch")

# rho beyond exp(20) is truncated or masked anyway; the bound keeps exp() finite.
_LOG_RHO_BOUND = 20.0


def mismatch_weights(
    old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cfg
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(w_BT or None when mode is ``none``, metrics as means over the micro-batch's response tokens)."""
    mask = mask_BT.to(torch.float32)
    log_rho = (old_logp_BT.detach() - rollout_logp_BT.detach()).float() * mask
    metrics = {
        "mismatch_kl": token_mean_metric(torch.exp(log_rho.clamp(max=_LOG_RHO_BOUND)) - 1.0 - log_rho, mask),
        "mismatch_abs_logp_diff": token_mean_metric(log_rho.abs(), mask),
    }
    if cfg.mode == "none":
        return None, metrics
    if cfg.mode.startswith("seq_"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(mask)
    rho = torch.exp(log_rho.clamp(-_LOG_RHO_BOUND, _LOG_RHO_BOUND))
    if cfg.mode.endswith("_truncate"):
        corrected = rho > cfg.cap
        w = rho.clamp(max=cfg.cap)
    else:
        corrected = (rho > cfg.cap) | (rho < cfg.lower)
        w = torch.where(corrected, torch.zeros_like(rho), rho)
    w = w * mask
    metrics["mismatch_is_weight"] = token_mean_metric(w, mask)
    metrics["mismatch_corrected_frac"] = token_mean_metric(corrected.float(), mask)
    return w, metrics
