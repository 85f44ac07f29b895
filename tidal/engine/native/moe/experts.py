"""The routed experts of one MoE layer, stored as ``transformers`` 5 stacks them, computed as a grouped
GEMM over the rows each expert received.

HF weights: ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows then up rows) and ``experts.down_proj``
``[E, H, I]``, or one tensor per expert and projection as checkpoints keep them on disk
(``experts.{e}.gate_proj.weight``, mapped by :func:`tidal.families.expert_weight`); expert ``e`` computes ``down_e(silu(gate_e x) * up_e x)``. Tensor parallelism splits
the intermediate dim ``I`` of every expert (each rank keeps ``I / tp`` gate, up and down columns) and
sums the ranks' outputs once after the combine, as the dense row-parallel MLP does.

Two ways to run the GEMMs, equal in math (tests/engine/test_native_moe.py compares them):
``grouped`` (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` with device-side offsets: one
launch per projection, no host sync, CUDA-graph capturable) and ``loop`` (one ``F.linear`` per expert
that received rows; reads the counts on the host, so it cannot be captured). CUDA uses ``grouped``
(SM80+, as ``transformers`` does; an older GPU is refused: its decode graphs could not capture the
loop); the CPU uses ``loop``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.engine.native.layers import _divide
from tidal.engine.native.moe.dispatch import Dispatch, combine, dispatch
from tidal.models.routing import Routing
from tidal.engine.native.parallel import TPGroup


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def default_impl(device: torch.device) -> str:
    """``grouped`` on CUDA, ``loop`` elsewhere; RuntimeError on a GPU without grouped GEMMs."""
    if device.type != "cuda":
        return "loop"
    if _GROUPED_MM is None or torch.cuda.get_device_capability(device) < (8, 0):
        raise RuntimeError("the native engine's MoE experts need torch grouped GEMMs on the GPU (torch >= 2.9, "
                           "compute capability 8.0+); use engine.backend: hf on this device")
    return "grouped"


class FusedExperts(nn.Module):
    """``mlp.experts``: all ``E`` experts of a layer as two stacked parameters (TP shards of ``I``)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, ops, dtype: torch.dtype):
        super().__init__()
        self.num_experts, self.tp, self.ops = num_experts, tp, ops
        self.inter = _divide(intermediate, tp.size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, self.inter, dtype=dtype), requires_grad=False)
        # exact mode (docs/exact.md) runs the loop: each expert's rows through the batch-invariant F.linear
        self.impl = "loop" if getattr(ops, "exact", False) else default_impl(self.gate_up_proj.device)

    def weight_slices(self, param, full, shard_id=None):
        """This rank's ``I / tp`` slice of every expert: gate and up rows of ``gate_up_proj``, columns of
        ``down_proj``. ``shard_id`` an :class:`~tidal.families.ExpertWeight`: ``full`` is one expert's
        ``gate_proj``/``up_proj`` ``[I, H]`` or ``down_proj`` ``[H, I]`` (a per-expert checkpoint),
        loaded into that expert's slice."""
        n, start = self.inter, self.tp.rank * self.inter
        if shard_id is not None:
            e = shard_id.expert
            if not 0 <= e < self.num_experts:
                raise KeyError(f"{shard_id.stacked}: expert {e} of a layer with {self.num_experts} experts")
            if param is self.gate_up_proj:
                return [(param.data[e, shard_id.half * n : (shard_id.half + 1) * n], full[start : start + n])]
            return [(param.data[e], full[:, start : start + n])]
        if param is self.gate_up_proj:
            whole = full.shape[1] // 2
            return [(param.data[:, :n], full[:, start : start + n]),
                    (param.data[:, n:], full[:, whole + start : whole + start + n])]
        return [(param.data, full[:, :, start : start + n])]

    def forward(self, x_TH: torch.Tensor, routing: Routing) -> torch.Tensor:
        d = dispatch(routing, self.num_experts)
        x_NH = x_TH[d.token_N]
        mlp = self._grouped if self.impl == "grouped" else self._loop
        out_TH = combine(mlp(x_NH, d), d, x_TH.shape[0])
        return self.tp.all_reduce(out_TH)

    def _grouped(self, x_NH: torch.Tensor, d: Dispatch) -> torch.Tensor:
        h_N2I = _GROUPED_MM(x_NH, self.gate_up_proj.transpose(1, 2), offs=d.offsets_E)
        return _GROUPED_MM(self.ops.silu_mul(h_N2I), self.down_proj.transpose(1, 2), offs=d.offsets_E)

    def _loop(self, x_NH: torch.Tensor, d: Dispatch) -> torch.Tensor:
        y_NH = torch.empty_like(x_NH)
        ends = d.offsets_E.tolist()
        for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
            if hi > lo:
                h = self.ops.silu_mul(F.linear(x_NH[lo:hi], self.gate_up_proj[e]))
                y_NH[lo:hi] = F.linear(h, self.down_proj[e])
        return y_NH
