"""Batch whitening and running moments (for reward and advantage normalisation).

Statistics are population moments over the selected elements; with a process ``group`` the
sums are all-reduced first (as a CPU tensor: the group must reduce CPU tensors, e.g. gloo), so
every rank normalises with the statistics of the global batch.
"""

from __future__ import annotations

from tidal.lazy import lazy_module

torch = lazy_module("torch")

_EPS = 1e-8


def _global_sums(x: torch.Tensor, mask: torch.Tensor, group) -> tuple[float, float, float]:
    """(count, sum, sum of squares) of x where mask, over the ranks of ``group`` if given."""
    x64 = x.detach().to(torch.float64)
    m64 = mask.to(torch.float64)
    sums = torch.stack([m64.sum(), (x64 * m64).sum(), (x64 * x64 * m64).sum()]).cpu()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    n, s, ss = (float(v) for v in sums)
    return n, s, ss


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked elements (population variance); 0 off the mask."""
    n, s, ss = _global_sums(x, mask, group)
    if n == 0:
        return torch.zeros_like(x)
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    return (x - mean) * (var + _EPS) ** -0.5 * mask


class RunningMoments:
    """Mean and variance of every value seen so far (Chan et al. parallel update, float64)."""

    def __init__(self):
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        return self.var**0.5

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None, group=None) -> None:
        mask = torch.ones_like(x) if mask is None else mask
        n, s, ss = _global_sums(x, mask, group)
        if n == 0:
            return
        b_mean = s / n
        b_m2 = max(ss - n * b_mean * b_mean, 0.0)
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, x: torch.Tensor, *, center: bool = True) -> torch.Tensor:
        shifted = x - self.mean if center else x
        return shifted / (self.std + _EPS)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
