"""Environments by name (``env.name``).

The built-in environments are named by import path, like a user's ``module:Class``: this module
imports none of them, so naming and validating a name never loads an environment. A user's own
environment can also be registered under a short name with ``@ENVIRONMENTS.register(name)`` (its
module must then be imported before the config is built)."""

from __future__ import annotations

import importlib

from tidal.registry import Registry

BUILT_IN: dict[str, str] = {
    "single_turn": "tidal.envs.single_turn:SingleTurnEnv",
    "calculator": "tidal.envs.calculator:CalculatorEnv",
    "python": "tidal.envs.python_tool:PythonToolEnv",
    # from the ecosystem: each needs its extra (tidal.optional_deps.ENV_EXTRAS), imported on first use
    "mcp": "tidal.envs.adapters.mcp:McpEnv",
    "openenv": "tidal.envs.adapters.openenv:OpenEnvEnv",
    "verifiers": "tidal.envs.adapters.verifiers:VerifiersEnv",  # runs its own episodes (VerifiersRollout)
}
ENVIRONMENTS: Registry = Registry("environment")


def known_names() -> list[str]:
    """Every short name ``env.name`` may take: the built-in ones and the registered ones."""
    return sorted(set(BUILT_IN) | set(ENVIRONMENTS.names()))


def named_class(name: str, key: str = "env.name") -> type:
    """The environment class of a short name: a built-in one (its module imported now: the built-in
    modules import no torch) or a registered one; ConfigError at ``key`` for an unknown name."""
    if name in BUILT_IN:
        module, _, attr = BUILT_IN[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    return ENVIRONMENTS.get(name, key)
