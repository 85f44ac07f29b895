"""The optional rollout engines (vLLM, SGLang): the check that their package is installed in a
supported version, cheap (nothing is imported) and run before any model loads. Which versions each
needs, and the install command, are owned by :mod:`tidal.optional_deps`."""

from __future__ import annotations

from tidal.optional_deps import require

EXTERNAL_BACKENDS = ("vllm", "sglang")


def check_backend_installed(backend: str) -> str:
    """Fail fast when ``engine.backend`` needs a package that is missing or of an unsupported
    version: a ConfigError at ``engine.backend`` naming the install command. Returns the installed
    version ("" for a built-in backend)."""
    if backend not in EXTERNAL_BACKENDS:
        return ""
    return require(backend, "engine.backend", f"engine.backend={backend}")
