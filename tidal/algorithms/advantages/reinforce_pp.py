"""REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++: An Efficient RLHF Algorithm
with Robustness to Both Prompt and Reward Models").

reinforce_pp:          G_t = sum_{s >= t} gamma^(s - t) r_s (r_t: per-token KL penalty, plus the
                       scalar reward at the last token); A = whiten(G) over all response tokens of
                       the global batch: (G - mean) / sqrt(var + 1e-8).
reinforce_pp_baseline: the scalar reward first has its prompt-group mean subtracted
                       (r_i - mean_g), then as above.
Returns are the un-whitened G.
"""

from __future__ import annotations

from tidal.algorithms.advantages.common import group_stats, returns_to_go, token_reward_BT
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput
from tidal.algorithms.normalization import masked_whiten
from tidal.algorithms.registry import ADVANTAGE_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
class ReinforcePP(AdvantageEstimator):
    discounts = True
    whitens_batch = True
    subtract_group_mean = False

    def __init__(self, cfg, group=None):
        self.gamma = cfg.gamma
        self.group = group

    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        mask = inp.action_mask_BT.to(torch.float32)
        rewards_B = inp.rewards_B.to(torch.float32)
        if self.subtract_group_mean:
            rewards_B = rewards_B - group_stats(rewards_B, inp.group_ids_B)[0]
        returns = returns_to_go(token_reward_BT(rewards_B, mask, inp.token_rewards_BT), mask, self.gamma)
        return masked_whiten(returns, mask, self.group), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
class ReinforcePPBaseline(ReinforcePP):
    group_baseline = True
    subtract_group_mean = True
