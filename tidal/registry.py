"""Name -> class registries for pluggable variants (advantage estimators, policy losses, rewards, ...)."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from tidal.config_base import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """A registry of classes by name. ``get`` raises ConfigError naming the config key on a miss."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def get(self, name: str, key: str) -> type[T]:
        if name not in self._items:
            raise ConfigError(key, f"unknown {self.kind} '{name}'; choose one of {sorted(self._items)}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)
