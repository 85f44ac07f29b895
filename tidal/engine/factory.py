"""Build the configured rollout engine."""

from __future__ import annotations

import dataclasses

import torch
from transformers import PretrainedConfig

from tidal.engine.backends import check_backend_installed
from tidal.engine.base import RolloutEngine
from tidal.engine.config import EngineConfig
from tidal.models.vision import is_vision_language

VL_UNSUPPORTED = ("vllm", "sglang")  # backends whose adapters take no images (yet)


def create_engine(
    hf_config: PretrainedConfig, cfg: EngineConfig, *, device: torch.device, dtype: torch.dtype, tp_group=None,
    seq_len: int | None = None, exact: bool = False,
) -> RolloutEngine:
    """An engine with the model's architecture and ``dtype`` weights (``engine.dtype`` resolved by the
    caller, :func:`tidal.dtypes.resolve_dtype`); its weights are loaded by weight sync. ``tp_group``:
    the rollout TP group (None for one rank); the engine's TP size is that group's size. ``seq_len``:
    the longest sequence the run generates (``data.max_prompt_len + rollout.max_new_tokens``), which
    sizes the native engine's sliding-window block pool as the memory plan does. ``exact``: exact
    mode (``numerics.exact``; native engine only, :func:`tidal.numerics.check_exact`)."""
    if cfg.sleep_level == "auto":
        # a run resolves it with its memory plan before it builds the engine (MemorySettings.run_config); an
        # engine built on its own (a script, a test) sleeps as a run without a plan does: level 1
        cfg = dataclasses.replace(cfg, sleep_level=1)
    if exact and cfg.backend != "native":
        raise ValueError(f"exact mode runs the native engine, not engine.backend={cfg.backend}")
    if cfg.backend in VL_UNSUPPORTED and is_vision_language(hf_config):
        raise ValueError(
            f"engine.backend={cfg.backend} cannot generate from image prompts yet ({type(hf_config).__name__} is a "
            f"vision-language model); set engine.backend=hf"
        )
    if cfg.backend == "native":
        from tidal.engine.native import NativeEngine
        from tidal.families import native_family

        native_family(hf_config)  # ConfigError naming what the native engine runs
        return NativeEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group, seq_len=seq_len, exact=exact)
    if cfg.backend == "hf":
        from tidal.engine.hf import HFEngine

        return HFEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    check_backend_installed(cfg.backend)
    if cfg.backend == "vllm":
        from tidal.engine.vllm import VLLMEngine

        return VLLMEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    if cfg.backend == "sglang":
        from tidal.engine.sglang import SGLangEngine

        return SGLangEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
    raise ValueError(f"engine.backend: unknown backend {cfg.backend!r}")
