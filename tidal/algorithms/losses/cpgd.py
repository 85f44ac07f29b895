"""CPGD loss, clipped policy gradient with policy drift (Liu et al. 2025, "CPGD: Toward Stable
Rule-based Reinforcement Learning for Language Models").

d_t = log(pi / pi_old);  l_t = -min(d_t A_t, clip(d_t, log(1 - clip_low), log(1 + clip_high)) A_t)
      + alpha * [(r_t - 1) - d_t]
The first term is the policy gradient on the log-ratio (no ratio factor: grad = -A grad log pi
inside the clip range, 0 outside on the improving side); the second is the k3 estimate of the
policy drift KL(pi_old || pi) with alpha = ``cpgd.drift_coef``.
"""

from __future__ import annotations

import math

from tidal.algorithms.aggregation import local_loss_metric, token_mean_metric
from tidal.algorithms.base import PolicyLoss
from tidal.algorithms.losses.common import approx_kl_BT, log_ratio_BT, weighted
from tidal.algorithms.registry import POLICY_LOSSES
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@POLICY_LOSSES.register("cpgd")
class CPGDLoss(PolicyLoss):
    ratio_clip = True

    def __init__(self, cfg):
        self.low = math.log(1.0 - cfg.clip_low)
        self.high = math.log(1.0 + cfg.clip_high)
        self.drift_coef = cfg.cpgd.drift_coef

    def __call__(self, logp_BT, old_logp_BT, adv_BT, mask_BT, agg, norm, *, weight_BT=None):
        adv = adv_BT.detach()
        lr = log_ratio_BT(logp_BT, old_logp_BT)
        surr1 = -adv * lr
        surr2 = -adv * lr.clamp(self.low, self.high)
        pg_BT = torch.maximum(surr1, surr2)
        drift_BT = torch.exp(lr) - 1.0 - lr
        pg = agg(weighted(pg_BT, weight_BT), mask_BT, norm)
        loss = pg + self.drift_coef * agg(drift_BT, mask_BT, norm) if self.drift_coef > 0 else pg
        metrics = {
            "pg_loss": local_loss_metric(pg, agg, mask_BT, norm),
            "clip_frac": token_mean_metric((surr2 > surr1).float(), mask_BT),
            "approx_kl": token_mean_metric(approx_kl_BT(lr), mask_BT),  # = the drift term's KL
        }
        return loss, metrics
