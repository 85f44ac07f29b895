"""The registry of environments by name (``env.name``); each built-in module registers itself on import."""

from __future__ import annotations

from tidal.registry import Registry

ENVIRONMENTS: Registry = Registry("environment")


def load_all() -> None:
    """Import every built-in environment so the registry is complete."""
    from tidal.envs import calculator, python_tool, single_turn  # noqa: F401
