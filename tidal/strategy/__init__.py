"""get_strategy(config): the training backend behind the Strategy interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:
    from tidal.distributed.runtime import Runtime
    from tidal.strategy.base import Strategy
    from tidal.strategy.config import StrategyConfig

_WHERE = {
    "Strategy": "tidal.strategy.base",
    "TrainState": "tidal.strategy.base",
    "StrategyConfig": "tidal.strategy.config",
    "OptimConfig": "tidal.strategy.config",
}
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)


def get_strategy(cfg: StrategyConfig, runtime: Runtime) -> Strategy:
    if cfg.backend == "fsdp2":
        from tidal.strategy.fsdp2 import FSDP2Strategy

        return FSDP2Strategy(cfg, runtime)
    if cfg.backend == "deepspeed":
        from tidal.optional_deps import require

        require("deepspeed", "strategy.backend", "strategy.backend=deepspeed")
        from tidal.strategy.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(cfg, runtime)
    raise ValueError(f"strategy.backend: unknown backend {cfg.backend!r}")


def memory_layout(backend: str):
    """The backend's own description of its bytes per rank (``trained``, ``frozen``, ``working``:
    :class:`~tidal.strategy.fsdp2.FSDP2Layout`, :class:`~tidal.strategy.deepspeed.DeepSpeedLayout`),
    composed by the memory plan before any model loads."""
    if backend == "fsdp2":
        from tidal.strategy.fsdp2 import FSDP2Layout

        return FSDP2Layout
    if backend == "deepspeed":
        from tidal.optional_deps import require

        require("deepspeed", "strategy.backend", "strategy.backend=deepspeed")
        from tidal.strategy.deepspeed import DeepSpeedLayout

        return DeepSpeedLayout
    raise ValueError(f"strategy.backend: unknown backend {backend!r}")


__all__ = ["get_strategy", "Strategy", "TrainState", "StrategyConfig", "OptimConfig"]
