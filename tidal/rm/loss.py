"""The Bradley-Terry reward-model loss and the pairwise statistics reported with it.

For pair p with rewards r_c = r(prompt, chosen) and r_r = r(prompt, rejected) (the model's single
logit), the preference probability is P(chosen > rejected) = sigmoid(r_c - r_r) (Bradley & Terry
1952; Ouyang et al. 2022, arXiv:2203.02155, eq. 1), and the loss of a batch of P pairs is

    L = mean_p [ -log sigmoid(r_c - r_r) + coef * (r_c + r_r)^2 ]

the second term (``center_rewards_coef``) pulling the rewards towards zero mean (Eisenstein et al.
2023, arXiv:2312.09244). Pairwise accuracy counts a pair as 1 when r_c > r_r, 0.5 on a tie (so a
constant model scores exactly 0.5) and 0 otherwise; the margin is r_c - r_r.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the per-pair quantities summed over pairs (then divided by the pair count over all ranks)
SUMMED = ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected")


def bradley_terry_loss(r_chosen_P: torch.Tensor, r_rejected_P: torch.Tensor, *, center_coef: float = 0.0) -> torch.Tensor:
    """loss_P: each pair's loss (see the module docstring), fp32."""
    r_c, r_r = r_chosen_P.float(), r_rejected_P.float()
    loss_P = -F.logsigmoid(r_c - r_r)
    if center_coef > 0:
        loss_P = loss_P + center_coef * (r_c + r_r) ** 2
    return loss_P


def pair_sums(r_chosen_P: torch.Tensor, r_rejected_P: torch.Tensor, loss_P: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the P pairs of each quantity in :data:`SUMMED` (0-d tensors, detached)."""
    r_c, r_r = r_chosen_P.detach().double(), r_rejected_P.detach().double()
    margin_P = r_c - r_r
    correct_P = (margin_P > 0).double() + 0.5 * (margin_P == 0).double()
    return {
        "loss": loss_P.detach().double().sum(), "accuracy": correct_P.sum(), "margin": margin_P.sum(),
        "reward_chosen": r_c.sum(), "reward_rejected": r_r.sum(),
    }


class PairMeans:
    """Means over pairs of :func:`pair_sums` quantities, reduced over ranks by :meth:`result`.
    Device tensors are added as they come; the host reads them once."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor | float] = {k: 0.0 for k in SUMMED}
        self.count = 0

    def add(self, sums: dict[str, torch.Tensor], count: int) -> None:
        for k in SUMMED:
            self.sums[k] = self.sums[k] + sums[k]
        self.count += count

    def result(self, all_reduce_sum) -> dict[str, float]:
        """``{name: mean}`` over every rank's pairs, plus ``pairs`` (the count);
        ``all_reduce_sum(list[float]) -> list[float]`` sums over ranks."""
        vals = [self.sums[k] for k in SUMMED]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if tensors:  # one device-to-host copy for all of them
            vals = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=tensors[0].device) for v in vals]).tolist()
        local = [float(v) for v in vals] + [float(self.count)]
        total = all_reduce_sum(local)
        n = total[-1]
        out = {k: total[i] / n if n > 0 else float("nan") for i, k in enumerate(SUMMED)}
        out["pairs"] = n
        return out
