"""Shared pieces of the estimators: per-group statistics, returns-to-go, outcome placement."""

from __future__ import annotations

from tidal.lazy import lazy_module

torch = lazy_module("torch")


def group_stats(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (mean_B, std_B, size_B) of its prompt group's rewards.

    std is the unbiased (Bessel) standard deviation, as torch.std in the GRPO reference code;
    it is 0 for groups of one sample.
    """
    _, inv_B = torch.unique(group_ids_B, return_inverse=True)
    n_groups = int(inv_B.max()) + 1 if inv_B.numel() else 0
    r = rewards_B.to(torch.float64)
    size_G = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv_B, torch.ones_like(r))
    sum_G = torch.zeros_like(size_G).index_add_(0, inv_B, r)
    mean_G = sum_G / size_G
    dev_B = r - mean_G[inv_B]
    ss_G = torch.zeros_like(size_G).index_add_(0, inv_B, dev_B * dev_B)
    std_G = torch.where(size_G > 1, (ss_G / (size_G - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss_G))
    dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    return mean_G[inv_B].to(dtype), std_G[inv_B].to(dtype), size_G[inv_B].to(dtype)


def num_groups(group_ids_B: torch.Tensor) -> int:
    return int(torch.unique(group_ids_B).numel())


def last_token_onehot_BT(mask_BT: torch.Tensor) -> torch.Tensor:
    """1 at the last response token of each row (rows without response tokens: all 0)."""
    mask = mask_BT.to(torch.float32)
    pos_BT = torch.arange(mask.shape[1], device=mask.device, dtype=torch.float32).expand_as(mask)
    last_B = (pos_BT * mask).argmax(-1)
    onehot = torch.zeros_like(mask).scatter_(1, last_B[:, None], 1.0)
    return onehot * (mask.sum(-1, keepdim=True) > 0)


def token_reward_BT(rewards_B: torch.Tensor, mask_BT: torch.Tensor, token_rewards_BT: torch.Tensor | None) -> torch.Tensor:
    """r_t: the scalar reward at the last response token plus the per-token rewards, 0 off the mask."""
    mask = mask_BT.to(torch.float32)
    r_BT = last_token_onehot_BT(mask) * rewards_B.to(torch.float32)[:, None]
    if token_rewards_BT is not None:
        r_BT = r_BT + token_rewards_BT.to(torch.float32) * mask
    return r_BT


def returns_to_go(r_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum over the sampled tokens s >= t of gamma^(k(s) - k(t)) r_s, where k counts the row's
    sampled tokens (mask 1): discounting runs over sampled tokens only, and the tokens between them
    (observations inside a multi-turn response, mask 0) neither discount nor reset the sum. r off
    the mask is ignored; G is 0 off the mask."""
    mask = mask_BT.to(r_BT.dtype)
    out = torch.zeros_like(r_BT)
    running = torch.zeros_like(r_BT[:, 0])
    for t in range(r_BT.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = m * (r_BT[:, t] + gamma * running) + (1 - m) * running
        out[:, t] = running * m
    return out


def outcome_advantage_BT(adv_B: torch.Tensor, mask_BT: torch.Tensor, token_rewards_BT: torch.Tensor | None) -> torch.Tensor:
    """A_t = adv_b on every response token, plus the undiscounted reward-to-go of the per-token
    rewards (the KL penalty when KL is in the reward), as OpenRLHF does for group baselines."""
    mask = mask_BT.to(torch.float32)
    adv_BT = adv_B.to(torch.float32)[:, None] * mask
    if token_rewards_BT is not None:
        adv_BT = adv_BT + returns_to_go(token_rewards_BT.to(torch.float32) * mask, mask, 1.0)
    return adv_BT
