"""Which rollout engine runs a model, and the optional engines' packages (vLLM, SGLang); both
checked cheaply (nothing heavy imported) before any model loads. Which versions each optional
engine needs, and the install command, are owned by :mod:`tidal.optional_deps`.

Choosing the engine (:func:`engine_choice`): ``engine.backend`` decides, never the model. The
native engine runs the families :mod:`tidal.families` lists with a native model; for another
model ``engine.backend: native`` (the default) is a ConfigError at ``engine.backend`` that names
the model_type, what the native engine runs and ``engine.backend: hf``, which runs any Hugging Face
causal LM (its own ``generate``: no paged KV, slower). There is no silent fallback."""

from __future__ import annotations

from typing import Any

from tidal import families
from tidal.optional_deps import require

EXTERNAL_BACKENDS = ("vllm", "sglang")


def check_backend_installed(backend: str) -> str:
    """Fail fast when ``engine.backend`` needs a package that is missing or of an unsupported
    version: a ConfigError at ``engine.backend`` naming the install command. Returns the installed
    version ("" for a built-in backend)."""
    if backend not in EXTERNAL_BACKENDS:
        return ""
    return require(backend, "engine.backend", f"engine.backend={backend}")


def engine_choice(hf_config: Any, backend: str) -> str:
    """The console line saying which engine runs the model of ``hf_config`` (a HF config or its
    ``config.json`` dict) and why; ConfigError at ``engine.backend`` when ``native`` cannot run it."""
    family = families.find_family(hf_config)
    if backend == "native":
        family = families.native_family(hf_config)  # ConfigError naming what runs and the hf fallback
        caches = families.layer_caches(hf_config)
        hybrid = "; its linear-attention layers decode without CUDA graphs" if any(c.kind == "recurrent" for c in caches) else ""
        return f"engine: native (engine.backend: native; Tidal's paged engine runs family {family.name}{hybrid})"
    if backend == "hf":
        if family is None or not family.native:
            mt = getattr(families.namespace(hf_config), "model_type", "?")
            why = f"model_type {mt!r} has no native engine model: the Hugging Face model's own generate runs it"
        else:
            why = f"the Hugging Face model's own generate; engine.backend: native also runs family {family.name}, faster"
        return f"engine: hf (engine.backend: hf; {why})"
    return f"engine: {backend} (engine.backend: {backend})"
