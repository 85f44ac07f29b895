"""PPO clipped surrogate (Schulman et al. 2017) with decoupled clip range (DAPO clip-higher,
Yu et al. 2025) and optional dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games").

r_t = pi / pi_old;  l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high));
dual-clip (c > 1): l_t = min(l_t, -c A_t) where A_t < 0.
"""

from __future__ import annotations

from tidal.algorithms.aggregation import local_loss_metric, token_mean_metric
from tidal.algorithms.base import PolicyLoss
from tidal.algorithms.losses.common import approx_kl_BT, log_ratio_BT, weighted
from tidal.algorithms.registry import POLICY_LOSSES
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@POLICY_LOSSES.register("ppo_clip")
class PPOClip(PolicyLoss):
    ratio_clip = True
    dual_clip = True

    def __init__(self, cfg):
        self.low = 1.0 - cfg.clip_low
        self.high = 1.0 + cfg.clip_high
        self.dual_c = cfg.dual_clip

    def __call__(self, logp_BT, old_logp_BT, adv_BT, mask_BT, agg, norm, *, weight_BT=None):
        adv = adv_BT.detach()
        lr = log_ratio_BT(logp_BT, old_logp_BT)
        ratio = torch.exp(lr)
        surr1 = -adv * ratio
        surr2 = -adv * ratio.clamp(self.low, self.high)
        loss_BT = torch.maximum(surr1, surr2)
        metrics = {"clip_frac": token_mean_metric((surr2 > surr1).float(), mask_BT)}
        if self.dual_c > 0:
            surr3 = -adv * self.dual_c
            dual = (adv < 0) & (loss_BT > surr3)
            loss_BT = torch.where(dual, surr3, loss_BT)
            metrics["dual_clip_frac"] = token_mean_metric(dual.float(), mask_BT)
        loss = agg(weighted(loss_BT, weight_BT), mask_BT, norm)
        metrics["pg_loss"] = local_loss_metric(loss, agg, mask_BT, norm)
        metrics["approx_kl"] = token_mean_metric(approx_kl_BT(lr), mask_BT)
        return loss, metrics
