"""get_strategy(config): the training backend behind the Strategy interface."""

from __future__ import annotations

from tidal.distributed.runtime import Runtime
from tidal.strategy.base import Strategy, TrainState
from tidal.strategy.config import OptimConfig, StrategyConfig


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


__all__ = ["get_strategy", "Strategy", "TrainState", "StrategyConfig", "OptimConfig"]
