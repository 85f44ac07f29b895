"""What the models with per-layer ``layer_types`` share (Gemma 3, OLMo 3): each layer's sliding
window, as its family declares it (:func:`tidal.families.layer_type_caches`), and a RoPE table per
layer type (``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.engine.native.layers import rope_cos_sin
from tidal.families import layer_type_caches


def layer_windows(cfg) -> list[int | None]:
    """The sliding window of each layer (None: full attention)."""
    return [c.window for c in layer_type_caches(cfg)]


class LayerTypeRope(nn.Module):
    """The ``[cos | sin]`` tables of the two layer types: ``cos_sin_PD`` (full attention) and
    ``cos_sin_local_PD`` (sliding attention; Gemma 3's ``rope_local_base_freq``)."""

    def __init__(self, cfg, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("cos_sin_PD", rope_cos_sin(cfg, head_dim, max_positions, dtype, "full_attention"), False)
        self.register_buffer("cos_sin_local_PD", rope_cos_sin(cfg, head_dim, max_positions, dtype, "sliding_attention"), False)

    def table(self, window: int | None) -> torch.Tensor:
        return self.cos_sin_PD if window is None else self.cos_sin_local_PD
