"""Where ``torch.compile`` keeps what it compiled, so later runs reuse it (``strategy.compile_cache_dir``).

torch caches compiled work on disk by content: Inductor's FX graph cache (generated code, with the
Triton kernels bundled), the AOTAutograd cache (forward/backward graphs) and Triton's kernel cache.
All three live under one directory, ``TORCHINDUCTOR_CACHE_DIR`` (Triton's under its ``triton/``
unless ``TRITON_CACHE_DIR`` is set). torch's default is ``/tmp/torchinductor_<user>``, which a
reboot or a fresh container loses; Tidal keeps it under the user's cache directory instead. A run
whose layers and shapes were compiled before still traces them (seconds) but skips code
generation and kernel compilation (most of a cold start).
"""

from __future__ import annotations

import os


def default_cache_root() -> str:
    """``$TIDAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tidal``, else ``~/.cache/tidal``."""
    if os.environ.get("TIDAL_CACHE_DIR"):
        return os.path.expanduser(os.environ["TIDAL_CACHE_DIR"])
    return os.path.join(os.path.expanduser(os.environ.get("XDG_CACHE_HOME") or "~/.cache"), "tidal")


def resolve_compile_cache_dir(setting: str) -> str | None:
    """The directory ``strategy.compile_cache_dir`` names: ``auto`` -> an existing
    ``TORCHINDUCTOR_CACHE_DIR`` (the user's choice wins) or ``<default_cache_root()>/torch_compile``;
    ``off`` -> None (torch's own default); anything else is a path (``~`` expanded)."""
    if setting == "off":
        return None
    if setting == "auto":
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(default_cache_root(), "torch_compile")
    return os.path.abspath(os.path.expanduser(setting))


def use_compile_cache(setting: str) -> str | None:
    """Point torch's compile caches at :func:`resolve_compile_cache_dir` (created if missing) and make
    sure the FX graph and AOTAutograd caches are on; returns the directory (None: torch's default).
    Call before the first compilation; later calls with the same setting change nothing."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    path = resolve_compile_cache_dir(setting)
    if path is not None:
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path
