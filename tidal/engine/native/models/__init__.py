"""The native engine's models, one module per family (``dense``: Qwen2/Qwen2.5/Qwen3/Llama and
Qwen2-VL/Qwen2.5-VL). Which class runs a config is its family's ``engine_model``
(:mod:`tidal.families`); :func:`build_model` builds it."""

from __future__ import annotations

import importlib

import torch

from tidal.engine.native.models.dense import DecoderLM, PagedLM, head_dim_of
from tidal.engine.native.parallel import TPGroup
from tidal.families import native_family

__all__ = ["DecoderLM", "PagedLM", "build_model", "head_dim_of", "model_class"]


def model_class(hf_config) -> type[PagedLM]:
    """The engine model class of ``hf_config``'s family; ConfigError at ``engine.backend`` when the
    native engine does not run it."""
    module, _, name = native_family(hf_config).engine_model.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(hf_config, tp: TPGroup, ops, device: torch.device, dtype: torch.dtype) -> PagedLM:
    """The model for ``hf_config``'s family on ``device`` with zero weights (load them next)."""
    cls = model_class(hf_config)
    with torch.device(device):
        return cls(hf_config, tp, ops, dtype).eval()
