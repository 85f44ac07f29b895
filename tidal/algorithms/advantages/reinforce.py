"""REINFORCE with returns (Williams 1992): A_t = G_t = sum_{s >= t} gamma^(s - t) r_s, where r_t is
the per-token reward (KL penalty if in the reward) plus the scalar reward at the last response
token. No baseline and no normalisation (use ``adv_norm`` for that)."""

from __future__ import annotations

from tidal.algorithms.advantages.common import returns_to_go, token_reward_BT
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput
from tidal.algorithms.registry import ADVANTAGE_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@ADVANTAGE_ESTIMATORS.register("reinforce")
class Reinforce(AdvantageEstimator):
    discounts = True
    def __init__(self, cfg, group=None):
        self.gamma = cfg.gamma

    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        mask = inp.action_mask_BT.to(torch.float32)
        returns = returns_to_go(token_reward_BT(inp.rewards_B, mask, inp.token_rewards_BT), mask, self.gamma)
        return returns, returns.clone()
