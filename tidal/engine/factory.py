"""Build the configured rollout engine."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tidal.engine.base import RolloutEngine
from tidal.engine.config import EngineConfig


def engine_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def create_engine(hf_config: PretrainedConfig, cfg: EngineConfig, *, device: torch.device, tp_group=None) -> RolloutEngine:
    """An engine with the model's architecture; its weights are loaded by ``update_engine_weights``."""
    dtype = engine_dtype(cfg, device)
    if cfg.backend == "native":
        from tidal.engine.native import NativeEngine

        return NativeEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    if cfg.backend == "hf":
        from tidal.engine.hf import HFEngine

        return HFEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    if cfg.backend == "vllm":
        from tidal.engine.vllm import VLLMEngine

        return VLLMEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    if cfg.backend == "sglang":
        from tidal.engine.sglang import SGLangEngine

        return SGLangEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    raise ValueError(f"engine.backend: unknown backend {cfg.backend!r}")
