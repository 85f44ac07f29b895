"""Configuration of checkpoints and resume (``checkpoint.*``)."""

from __future__ import annotations

import dataclasses

from tidal.config_base import check


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """every: save every N steps (0: only at the end if at_end). keep: newest checkpoints kept.
    resume: ``auto`` (continue from the newest complete checkpoint in output_dir, if any),
    ``never`` (a fresh run; refused in a run directory holding an earlier run's checkpoints or metrics:
    it would delete them or rotate its own checkpoints away), or a checkpoint directory path.
    """

    every: int = 0
    at_end: bool = True
    keep: int = 2
    resume: str = "auto"

    def __post_init__(self):
        check(self.every >= 0, "every", "must be >= 0")
        check(self.keep >= 1, "keep", "must be >= 1")
        check(bool(self.resume), "resume", "must be 'auto', 'never' or a checkpoint path")
