"""CPGD advantages (Liu et al. 2025, "CPGD: Toward Stable Rule-based Reinforcement Learning for
Language Models"): group baseline with a weighting factor, per prompt group g.

std:              A_i = (r_i - mean_g) / (std_g + 1e-6)
equal:            A_i = r_i - mean_g
clip_filter_like: A_i = min(G / G_valid, 3) (r_i - mean_g), G = groups in the batch, G_valid =
                  groups whose rewards are not all equal (re-weights the batch like a filter that
                  drops zero-signal groups would).
Statistics are per prompt group (a batch-wide mean over a single group's samples would make
every advantage 0).
"""

from __future__ import annotations

from tidal.algorithms.advantages.common import group_stats, num_groups, outcome_advantage_BT
from tidal.algorithms.advantages.grpo import GRPO_EPS
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput
from tidal.algorithms.registry import ADVANTAGE_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")

CLIP_FILTER_MAX_WEIGHT = 3.0


@ADVANTAGE_ESTIMATORS.register("cpgd")
class CPGD(AdvantageEstimator):
    group_baseline = True
    def __init__(self, cfg, group=None):
        self.weight = cfg.cpgd.weight

    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        mean_B, std_B, _ = group_stats(inp.rewards_B, inp.group_ids_B)
        centred_B = inp.rewards_B.to(mean_B.dtype) - mean_B
        if self.weight == "std":
            adv_B = centred_B / (std_B + GRPO_EPS)
        elif self.weight == "clip_filter_like":
            adv_B = centred_B * self._clip_filter_weight(std_B, inp.group_ids_B)
        else:
            adv_B = centred_B
        adv_BT = outcome_advantage_BT(adv_B, inp.action_mask_BT, inp.token_rewards_BT)
        return adv_BT, adv_BT.clone()

    @staticmethod
    def _clip_filter_weight(std_B: torch.Tensor, group_ids_B: torch.Tensor) -> float:
        valid_ids = group_ids_B[std_B > 0]
        n_valid = num_groups(valid_ids) if valid_ids.numel() else 0
        if n_valid == 0:
            return 0.0
        return min(num_groups(group_ids_B) / n_valid, CLIP_FILTER_MAX_WEIGHT)
