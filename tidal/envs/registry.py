"""Environments by name (``env.name``).

The built-in environments are named by import path, like a user's ``module:Class``: this module
imports none of them, so naming and validating a name never loads an environment. A user's own
environment can also be registered under a short name with ``@ENVIRONMENTS.register(name)`` (its
module must then be imported before the config is built)."""

from __future__ import annotations

from tidal.registry import Registry

BUILT_IN: dict[str, str] = {
    "single_turn": "tidal.envs.single_turn:SingleTurnEnv",
    "calculator": "tidal.envs.calculator:CalculatorEnv",
    "python": "tidal.envs.python_tool:PythonToolEnv",
}
ENVIRONMENTS: Registry = Registry("environment")


def known_names() -> list[str]:
    """Every short name ``env.name`` may take: the built-in ones and the registered ones."""
    return sorted(set(BUILT_IN) | set(ENVIRONMENTS.names()))
