"""Reward shaping and sample selection before advantages (DAPO, Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale").

overlong_penalty_B: soft overlong punishment; L = response length, L_max = max_len, L_c = buffer:
    0 if L <= L_max - L_c;  (L_max - L_c - L) / L_c * factor if L_max - L_c < L <= L_max;  -factor beyond.
nonzero_variance_groups_B: dynamic sampling keeps only prompt groups whose rewards are not all
    equal (|max - min| > 1e-6), as groups of equal rewards have zero advantage.
"""

from __future__ import annotations

from tidal.lazy import lazy_module

torch = lazy_module("torch")

# Rewards closer than this are "equal" for dynamic sampling (float rewards from sums of parts).
_EQUAL_TOL = 1e-6


def overlong_penalty_B(response_len_B: torch.Tensor, cfg) -> torch.Tensor:
    length = response_len_B.to(torch.float32)
    start = float(cfg.max_len - cfg.buffer_len)
    inside = (start - length) / cfg.buffer_len
    penalty = torch.where(length <= start, torch.zeros_like(length), inside)
    penalty = torch.where(length > cfg.max_len, torch.full_like(length, -1.0), penalty)
    return penalty * cfg.penalty_factor


def nonzero_variance_groups_B(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    _, inv_B = torch.unique(group_ids_B, return_inverse=True)
    n_groups = int(inv_B.max()) + 1 if inv_B.numel() else 0
    r = rewards_B.to(torch.float64)
    max_G = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, inv_B, r, "amax")
    min_G = torch.full((n_groups,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, inv_B, r, "amin")
    return (max_G - min_G > _EQUAL_TOL)[inv_B]
