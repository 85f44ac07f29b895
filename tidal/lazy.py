"""Imports deferred to first use, so that ``tidal --help`` and a config error never import torch.

Building and validating a config reads only the config dataclasses and the registries of named
variants (advantage estimators, losses, environments, reward rules). Their modules name torch, numpy
or transformers only inside functions; two helpers keep importing them from paying for that:

- :func:`lazy_module`: ``torch = lazy_module("torch")`` binds a stand-in that imports the module at
  its first attribute read;
- :func:`lazy_exports`: a package ``__init__`` that re-exports names from its modules imports each
  module when one of its names is first read (PEP 562 module ``__getattr__``).

``tests/unit/test_fast_start.py`` checks that the CLI's help and a config error import none of them.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable


class LazyModule:
    """Stands for the module ``name`` and imports it when an attribute of it is first read.

    Unlike :class:`importlib.util.LazyLoader` it never puts a half-made module into
    ``sys.modules``: an ordinary ``import torch.distributed`` elsewhere, before or after, imports the
    one real module (a lazily loaded package whose submodule is imported first would run its C
    extension's initialisation twice)."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


def lazy_module(name: str) -> LazyModule:
    """``torch = lazy_module("torch")``: the module ``name``, imported at its first attribute read."""
    return LazyModule(name)


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``package``: ``where`` maps each exported name to
    the module that defines it, imported on the name's first read."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
