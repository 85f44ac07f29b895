"""Metrics logging (console, JSONL, TensorBoard, W&B), phase timers and trajectory files."""

from tidal.logging.config import LoggingConfig
from tidal.logging.metrics import MetricsLogger
from tidal.logging.timer import PhaseObserver, PhaseTimer
from tidal.logging.trajectories import TrajectoryWriter

__all__ = ["LoggingConfig", "MetricsLogger", "PhaseObserver", "PhaseTimer", "TrajectoryWriter"]
