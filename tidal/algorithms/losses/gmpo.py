"""GMPO, geometric-mean policy optimisation (Zhao et al. 2025, "Geometric-Mean Policy Optimization").

Per sequence i with (sequence-level) advantage A_i and log-ratios d_t = log(pi / pi_old):
    d~_t = sgn(A_i) min(sgn(A_i) d_t, sgn(A_i) clip(d_t, -clip_low, clip_high))   (pessimistic clip)
    l_i  = -A_i exp(mean_t d~_t)          (geometric mean of the clipped token ratios)
l_i is given to every response token of i, so seq_mean_token_mean aggregation yields the paper's
mean over sequences. The clip range is in log space (the paper uses 0.4 both ways).
"""

from __future__ import annotations

from tidal.algorithms.aggregation import local_loss_metric, token_mean_metric
from tidal.algorithms.base import PolicyLoss
from tidal.algorithms.losses.common import approx_kl_BT, log_ratio_BT, weighted
from tidal.algorithms.registry import POLICY_LOSSES
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@POLICY_LOSSES.register("gmpo")
class GMPO(PolicyLoss):
    sequence_ratio = True

    def __init__(self, cfg):
        self.low = -cfg.clip_low
        self.high = cfg.clip_high

    def __call__(self, logp_BT, old_logp_BT, adv_BT, mask_BT, agg, norm, *, weight_BT=None):
        mask = mask_BT.to(logp_BT.dtype)
        len_B = mask.sum(-1).clamp(min=1)
        adv_B = (adv_BT.detach() * mask).sum(-1) / len_B
        sgn = torch.sign(adv_B)[:, None]
        lr = log_ratio_BT(logp_BT, old_logp_BT)
        lr_clip = lr.clamp(self.low, self.high)
        pessimistic = torch.minimum(sgn * lr, sgn * lr_clip)
        lr_min = sgn * pessimistic
        ratio_B = torch.exp((lr_min * mask).sum(-1) / len_B)
        loss_BT = (-adv_B * ratio_B)[:, None].expand_as(logp_BT)
        loss = agg(weighted(loss_BT, weight_BT), mask_BT, norm)
        metrics = {
            "pg_loss": local_loss_metric(loss, agg, mask_BT, norm),
            "clip_frac": token_mean_metric((sgn * lr_clip < sgn * lr).float(), mask_BT),
            "approx_kl": token_mean_metric(approx_kl_BT(lr), mask_BT),
        }
        return loss, metrics
