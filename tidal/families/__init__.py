"""Model families: each declared once in ``tidal/families/<name>.py`` as ``FAMILY = Family(...)``.

:func:`family_of` maps a HF config (object or ``config.json`` dict) to its :class:`Family`;
everything that reads a model's shape asks it (see :mod:`tidal.families.base`). Torch-free: ``tidal
check`` names an unsupported family before anything heavy is imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from tidal.config_base import ConfigError
from tidal.families.base import (
    CACHE_KINDS,
    DEFAULT_LORA_TARGETS,
    PACKED_KERNELS,
    ExpertWeight,
    Family,
    LayerCache,
    MoEShape,
    expert_weight,
    full_attention_caches,
    head_dim_of,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_heads_of,
    layer_type_caches,
    namespace,
    state_bytes_per_sequence,
    text_config,
    text_tower_name,
)

__all__ = [
    "CACHE_KINDS", "DEFAULT_LORA_TARGETS", "PACKED_KERNELS", "ExpertWeight", "Family", "LayerCache", "MoEShape", "expert_weight", "families", "family_of", "find_family",
    "full_attention_caches", "head_dim_of", "kv_bytes_per_sequence", "kv_bytes_per_token", "kv_heads_of",
    "layer_caches", "layer_type_caches", "namespace", "native_family", "native_model_types", "state_bytes_per_sequence", "text_config", "text_tower_name",
]

_NOT_FAMILIES = {"base"}
_BY_MODEL_TYPE: dict[str, Family] = {}


def families() -> list[Family]:
    """Every registered family (the ``FAMILY`` of each module of this package), by name."""
    if not _BY_MODEL_TYPE:
        found: dict[str, Family] = {}
        for info in pkgutil.iter_modules(__path__):
            if info.name in _NOT_FAMILIES or info.name.startswith("_"):
                continue
            fam = importlib.import_module(f"{__name__}.{info.name}").FAMILY
            for mt in fam.model_types:
                if mt in found:
                    raise ValueError(f"model_type {mt!r} is declared by families {found[mt].name} and {fam.name}")
                found[mt] = fam
        _BY_MODEL_TYPE.update(found)
    return sorted({f.name: f for f in _BY_MODEL_TYPE.values()}.values(), key=lambda f: f.name)


def native_model_types() -> list[str]:
    """The HF model_types the native engine runs."""
    families()
    return sorted(mt for mt, f in _BY_MODEL_TYPE.items() if f.native)


def _model_types(config: Any) -> list[str]:
    """The config's own model_type, then its text config's (a ConditionalGeneration's text tower)."""
    top = namespace(config)
    types_ = [str(getattr(top, "model_type", "") or "")]
    text = text_config(config)
    if text is not top:
        types_.append(str(getattr(text, "model_type", "") or ""))
    return [t for t in types_ if t]


def find_family(config: Any) -> Family | None:
    """The family of a HF config (object or ``config.json`` dict), None when no family declares its
    model_type (nor its text config's)."""
    families()
    for mt in _model_types(config):
        if mt in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[mt]
    return None


def family_of(config: Any, *, key: str = "model.path") -> Family:
    """The family of a HF config (object or ``config.json`` dict). ConfigError at ``key`` naming the
    model_type, the families the native engine runs, and ``engine.backend: hf`` for the others."""
    family = find_family(config)
    if family is not None:
        return family
    types_ = _model_types(config)
    raise ConfigError(key, f"model_type {types_[0] if types_ else '(none)'!r} is no family Tidal knows; "
                           f"the native engine runs {native_model_types()}; any other Hugging Face causal LM "
                           f"runs with engine.backend: hf")


def native_family(config: Any) -> Family:
    """The family of a config that ``engine.backend: native`` is to run; ConfigError at
    ``engine.backend`` naming what the native engine runs when it does not run this one."""
    try:
        family = family_of(config, key="engine.backend")
    except ConfigError as e:
        raise ConfigError("engine.backend", f"native: {e.message}") from None
    if not family.native:
        raise ConfigError("engine.backend", f"native: the native engine does not run family {family.name!r} "
                                            f"(it runs {native_model_types()}); set engine.backend: hf")
    return family


def layer_caches(config: Any) -> list[LayerCache]:
    """Each decoder layer's cache of a HF config (object or dict), as its family declares."""
    return family_of(config).layer_caches(text_config(config))
