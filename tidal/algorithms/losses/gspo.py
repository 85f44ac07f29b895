"""GSPO, sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy Optimization").

s_i = exp(mean_t log(pi / pi_old)) over the response tokens of sequence i, in its token form
s_{i,t} = sg[s_i] pi(y_t) / sg[pi(y_t)] (same value, gradient s_i grad log pi(y_t));
l_{i,t} = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - clip_low, 1 + clip_high)).
With seq_mean_token_mean aggregation (as in the paper) this is the sequence objective; the paper's
clip range is ~3e-4 / 4e-4, far smaller than PPO's.
"""

from __future__ import annotations

from tidal.algorithms.aggregation import local_loss_metric, token_mean_metric
from tidal.algorithms.base import PolicyLoss
from tidal.algorithms.losses.common import LOG_RATIO_BOUND, approx_kl_BT, log_ratio_BT, weighted
from tidal.algorithms.registry import POLICY_LOSSES
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@POLICY_LOSSES.register("gspo")
class GSPO(PolicyLoss):
    ratio_clip = True
    sequence_ratio = True

    def __init__(self, cfg):
        self.low = 1.0 - cfg.clip_low
        self.high = 1.0 + cfg.clip_high

    def __call__(self, logp_BT, old_logp_BT, adv_BT, mask_BT, agg, norm, *, weight_BT=None):
        adv = adv_BT.detach()
        mask = mask_BT.to(logp_BT.dtype)
        lr = log_ratio_BT(logp_BT, old_logp_BT)
        seq_lr_B = (lr * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_s = (logp_BT - logp_BT.detach() + seq_lr_B.detach()[:, None]).clamp(max=LOG_RATIO_BOUND)
        s = torch.exp(log_s)
        surr1 = -adv * s
        surr2 = -adv * s.clamp(self.low, self.high)
        loss_BT = torch.maximum(surr1, surr2)
        loss = agg(weighted(loss_BT, weight_BT), mask_BT, norm)
        metrics = {
            "pg_loss": local_loss_metric(loss, agg, mask_BT, norm),
            "clip_frac": token_mean_metric((surr2 > surr1).float(), mask_BT),
            "approx_kl": token_mean_metric(approx_kl_BT(lr), mask_BT),
        }
        return loss, metrics
