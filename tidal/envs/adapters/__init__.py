"""Environments from the ecosystem, each behind an optional extra imported only when used
(docs/agentic.md, "Environments from the ecosystem"): MCP tool servers (:mod:`.mcp`, ``env.name:
mcp``) and OpenEnv environments (:mod:`.openenv`, ``env.name: openenv``). Every one of them goes
through the rollout's token-in/token-out path: its observations are rendered by the chat template
and appended (:mod:`tidal.envs.chat`), never re-encoding what the engine sampled.
"""

from __future__ import annotations

import importlib
from typing import Any

from tidal.config_base import ConfigError, check


def import_object(path: str, key: str) -> Any:
    """The object ``module:attr`` names (ConfigError at ``key`` when it cannot be imported)."""
    module, _, attr = path.partition(":")
    check(bool(module) and bool(attr), key, f"expected module:attr, got {path!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(key, f"cannot import {path!r}: {type(e).__name__}: {e}") from None
