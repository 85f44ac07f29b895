"""GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"), the PPO estimator with a critic.

r_t = token reward (KL penalty if in the reward) + the scalar reward at the last response token;
delta_t = r_t + gamma V_{t+1} - V_t (V = 0 past the last response token);
A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t (the critic's target).
t and t+1 are consecutive SAMPLED tokens (mask 1): in a multi-turn row the observation tokens
between two turns are skipped, so the last token of a turn bootstraps from the value of the
first token of the next turn, and the result equals GAE on the row with the gaps removed.
"""

from __future__ import annotations

from tidal.algorithms.advantages.common import token_reward_BT
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput
from tidal.algorithms.registry import ADVANTAGE_ESTIMATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")


@ADVANTAGE_ESTIMATORS.register("gae")
class GAE(AdvantageEstimator):
    needs_critic = True
    discounts = True

    def __init__(self, cfg, group=None):
        self.gamma = cfg.gamma
        self.lam = cfg.lam

    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        if inp.values_BT is None:
            raise ValueError("gae needs critic values (AdvantageInput.values_BT)")
        mask = inp.action_mask_BT.to(torch.float32)
        values = inp.values_BT.to(torch.float32) * mask
        rewards = token_reward_BT(inp.rewards_B, mask, inp.token_rewards_BT)
        adv = torch.zeros_like(values)
        next_adv = torch.zeros_like(values[:, 0])
        next_value = torch.zeros_like(values[:, 0])
        for t in range(values.shape[1] - 1, -1, -1):
            # Off the mask (observation tokens between turns, prompt, padding) nothing happens: the
            # recursion carries A and V of the next sampled token across the gap.
            m = mask[:, t]
            delta = rewards[:, t] + self.gamma * next_value - values[:, t]
            adv_t = (delta + self.gamma * self.lam * next_adv) * m
            adv[:, t] = adv_t
            next_adv = adv_t + (1 - m) * next_adv
            next_value = m * values[:, t] + (1 - m) * next_value
        return adv, (adv + values) * mask
