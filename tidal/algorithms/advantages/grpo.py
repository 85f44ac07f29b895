"""GRPO group-normalised advantages (Shao et al. 2024, "DeepSeekMath") and Dr.GRPO
(Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").

grpo:    A_i = (r_i - mean_g) / (std_g + 1e-6)   (std unbiased, over the prompt group g of i)
dr_grpo: A_i = r_i - mean_g                      (no std scaling: no per-question difficulty bias)
A_i is given to every response token (plus the reward-to-go of per-token rewards, if any).
Groups of one sample get A = 0.
"""

from __future__ import annotations

from tidal.algorithms.advantages.common import group_stats, outcome_advantage_BT
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput
from tidal.algorithms.registry import ADVANTAGE_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")

GRPO_EPS = 1e-6


@ADVANTAGE_ESTIMATORS.register("grpo")
class GRPO(AdvantageEstimator):
    group_baseline = True
    scale_by_std = True

    def __init__(self, cfg, group=None):
        pass

    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        mean_B, std_B, _ = group_stats(inp.rewards_B, inp.group_ids_B)
        adv_B = inp.rewards_B.to(mean_B.dtype) - mean_B
        if self.scale_by_std:
            adv_B = adv_B / (std_B + GRPO_EPS)
        adv_BT = outcome_advantage_BT(adv_B, inp.action_mask_BT, inp.token_rewards_BT)
        return adv_BT, adv_BT.clone()


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
class DrGRPO(GRPO):
    scale_by_std = False
