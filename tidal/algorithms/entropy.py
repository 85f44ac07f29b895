"""High-entropy-token selection (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority
Tokens Drive Effective Reinforcement Learning for LLM Reasoning").

Only the top-q fraction of response tokens by entropy (within the micro-batch: k = ceil(q * n)
tokens, ties at the threshold included) receive the policy gradient. The loss normaliser stays
the count of ALL response tokens, as in the paper's objective (1 / sum_i |o_i|) sum I[H >= tau].
"""

from __future__ import annotations

import math

from tidal.lazy import lazy_module

torch = lazy_module("torch")


def top_entropy_mask_BT(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, q: float) -> torch.Tensor:
    """mask_BT restricted to tokens whose entropy is among the top q fraction of masked tokens."""
    mask = mask_BT.to(torch.bool)
    values = entropy_BT.detach()[mask]
    if values.numel() == 0 or q >= 1.0:
        return mask_BT.to(torch.float32)
    k = max(1, math.ceil(q * values.numel()))
    threshold = torch.topk(values, k).values[-1]
    return (mask & (entropy_BT.detach() >= threshold)).to(torch.float32)
