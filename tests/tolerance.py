"""Tolerances for comparing two computations of the same value that differ only in rounding.

Two exact-in-math paths (one batch against micro-batches, a chunked against a whole-tensor
computation, another thread count) sum the same terms in another order and block matmuls
differently, so their float results differ by a few units of the dtype's epsilon *at the magnitude
of the values involved* -- not by a fixed absolute number: 1e-6 is 8 ulps at 1.0 in float32 but
only 2 at 4.0, and a CPU with other SIMD widths or thread counts rounds differently. So a test
derives its tolerance from the dtype and the magnitude it compares, and a slightly wrong
implementation (a micro-batch weighted wrongly, a token dropped) still fails by orders of magnitude.
"""

from __future__ import annotations

import torch

ROUNDING_ULPS = 64  # a few ulps per reduction, through a few layers of a tiny model (measured <= 10)


def rounding_tol(dtype: torch.dtype, magnitude: float | torch.Tensor, *, ulps: int = ROUNDING_ULPS) -> float:
    """Absolute tolerance: ``ulps`` epsilons of ``dtype`` at ``magnitude`` (a number, or a tensor's
    largest absolute value). Pass the magnitude of the terms that were summed: a value near 0 that
    came from cancelling larger terms carries their rounding."""
    if isinstance(magnitude, torch.Tensor):
        magnitude = magnitude.detach().abs().max().item() if magnitude.numel() else 0.0
    return ulps * torch.finfo(dtype).eps * abs(float(magnitude))
