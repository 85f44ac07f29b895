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
        try:
            from tidal.strategy.deepspeed import DeepSpeedStrategy
        except ImportError as e:
            raise ValueError(f"strategy.backend=deepspeed needs the extra: pip install 'tidal-rft[deepspeed]' ({e})") from None
        return DeepSpeedStrategy(cfg, runtime)
    raise ValueError(f"strategy.backend: unknown backend {cfg.backend!r}")


__all__ = ["get_strategy", "Strategy", "TrainState", "StrategyConfig", "OptimConfig"]
