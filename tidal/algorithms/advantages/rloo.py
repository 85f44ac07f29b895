"""RLOO leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").

A_i = r_i - mean_{j in g, j != i} r_j = n/(n-1) (r_i - mean_g), for a group g of n >= 2 samples
(A = 0 for groups of one). A_i is given to every response token (plus the reward-to-go of
per-token rewards, if any).
"""

from __future__ import annotations

from tidal.algorithms.advantages.common import group_stats, outcome_advantage_BT
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput
from tidal.algorithms.registry import ADVANTAGE_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@ADVANTAGE_ESTIMATORS.register("rloo")
class RLOO(AdvantageEstimator):
    group_baseline = True
    def __init__(self, cfg, group=None):
        pass

    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        mean_B, _, size_B = group_stats(inp.rewards_B, inp.group_ids_B)
        scale_B = torch.where(size_B > 1, size_B / (size_B - 1).clamp(min=1), torch.zeros_like(size_B))
        adv_B = scale_B * (inp.rewards_B.to(mean_B.dtype) - mean_B)
        adv_BT = outcome_advantage_BT(adv_B, inp.action_mask_BT, inp.token_rewards_BT)
        return adv_BT, adv_BT.clone()
