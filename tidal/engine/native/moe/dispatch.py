"""Token dispatch for grouped expert GEMMs: the ``T*K`` (token, slot) pairs of a routing, sorted by
expert, and the weighted sum of the expert outputs back onto the tokens.

Every shape depends only on ``T``, ``K`` and ``E`` (never on how many tokens an expert got), and no
step reads a device value on the host, so a decode step built from these is CUDA-graph capturable;
the per-expert row counts live on the device (``offsets_E``) for the grouped GEMM to read.
"""

from __future__ import annotations

import dataclasses

import torch

from tidal.models.routing import Routing


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """``N = T*K`` routed rows sorted by expert (stable: within an expert, in token order).

    ``token_N``: the token each sorted row came from; ``weight_N``: its gate weight;
    ``offsets_E``: int32 cumulative row counts (expert ``e`` owns rows ``offsets[e-1]:offsets[e]``)."""

    token_N: torch.Tensor
    weight_N: torch.Tensor
    offsets_E: torch.Tensor


def dispatch(routing: Routing, num_experts: int) -> Dispatch:
    experts_N = routing.experts_TK.reshape(-1)
    order_N = torch.argsort(experts_N, stable=True)
    top_k = routing.experts_TK.shape[-1]
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=experts_N.device)
    counts_E.scatter_add_(0, experts_N, torch.ones_like(experts_N, dtype=torch.int32))
    return Dispatch(
        token_N=order_N // top_k,
        weight_N=routing.weights_TK.reshape(-1)[order_N],
        offsets_E=torch.cumsum(counts_E, 0, dtype=torch.int32),
    )


def combine(y_NH: torch.Tensor, d: Dispatch, num_tokens: int) -> torch.Tensor:
    """``out_TH[t] = sum over t's rows n of weight_N[n] * y_NH[n]``, accumulated in ``y_NH``'s dtype
    (as HF's experts module does)."""
    out_TH = torch.zeros(num_tokens, y_NH.shape[-1], dtype=y_NH.dtype, device=y_NH.device)
    return out_TH.index_add_(0, d.token_N, y_NH * d.weight_N[:, None].to(y_NH.dtype))
