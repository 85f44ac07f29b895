"""CISPO, clipped IS-weight policy optimisation (MiniMax 2025, "MiniMax-M1").

l_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] A_t log pi(y_t): every token keeps a gradient,
only its importance weight is clipped (clip_low = 1: no lower bound). Computed as
-sg[w] A exp(log pi - sg[log pi]), which has the same gradient and the value -w A (comparable to
PPO's surrogate).
"""

from __future__ import annotations

from tidal.algorithms.aggregation import local_loss_metric, token_mean_metric
from tidal.algorithms.base import PolicyLoss
from tidal.algorithms.losses.common import approx_kl_BT, log_ratio_BT, weighted
from tidal.algorithms.registry import POLICY_LOSSES
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@POLICY_LOSSES.register("cispo")
class CISPO(PolicyLoss):
    weight_clip = True

    def __init__(self, cfg):
        self.low = 1.0 - cfg.clip_low
        self.high = 1.0 + cfg.clip_high

    def __call__(self, logp_BT, old_logp_BT, adv_BT, mask_BT, agg, norm, *, weight_BT=None):
        adv = adv_BT.detach()
        lr = log_ratio_BT(logp_BT, old_logp_BT)
        ratio = torch.exp(lr.detach())
        w = ratio.clamp(self.low, self.high)
        loss_BT = -w * adv * torch.exp(logp_BT - logp_BT.detach())
        loss = agg(weighted(loss_BT, weight_BT), mask_BT, norm)
        clipped = (ratio < self.low) | (ratio > self.high)
        metrics = {
            "pg_loss": local_loss_metric(loss, agg, mask_BT, norm),
            "clip_frac": token_mean_metric(clipped.float(), mask_BT),
            "approx_kl": token_mean_metric(approx_kl_BT(lr), mask_BT),
        }
        return loss, metrics
