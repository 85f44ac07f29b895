"""Metrics logging (console, JSONL, TensorBoard, W&B), phase timers and trajectory files."""

from tidal.lazy import lazy_exports

_WHERE = {
    "LoggingConfig": "tidal.logging.config",
    "MetricsLogger": "tidal.logging.metrics",
    "PhaseObserver": "tidal.logging.timer",
    "PhaseTimer": "tidal.logging.timer",
    "TrajectoryWriter": "tidal.logging.trajectories",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
