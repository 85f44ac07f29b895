"""Configuration of metrics logging (``logging.*``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.config_base import check

Backend = Literal["console", "jsonl", "tensorboard", "wandb"]


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Where step metrics go (``logging.*``); only the main rank writes.

    backends: any of ``console`` (one compact line per logged step, a step bar on a terminal), ``jsonl``
        (``RUN_DIR/metrics.jsonl``, one object per logged step), ``tensorboard`` (``RUN_DIR/tb``),
        ``wandb``; ``tensorboard`` and ``wandb`` need their extras
        (``pip install -e '.[tensorboard]'``, ``[wandb]``, checked before anything loads).
    wandb_project: W&B project name. wandb_mode: ``offline`` (files under ``RUN_DIR/wandb``, sync
        later with ``wandb sync``) or ``online``.
    log_every: write every N-th step (and the last); each written value combines that key over
        the steps since the previous write (the mean; the max of ``*_max``, the min of ``*_min``),
        so sparse keys (eval/*) are never lost.
    table_every: the console also prints a table of every metric every N logged steps (and at the
        last step); 0: never.
    trajectories_every: save prompts, responses, rewards and logprobs to
        ``RUN_DIR/trajectories/step_XXXXXX.jsonl`` every N steps (0: never).
    """

    backends: list[Backend] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    wandb_project: str = "tidal"
    wandb_mode: Literal["offline", "online"] = "offline"
    log_every: int = 1
    table_every: int = 10
    trajectories_every: int = 0

    def __post_init__(self):
        check(len(set(self.backends)) == len(self.backends), "backends", f"lists a backend twice: {self.backends}")
        check(self.log_every >= 1, "log_every", f"must be >= 1, got {self.log_every}")
        check(self.table_every >= 0, "table_every", f"must be >= 0 (0: never), got {self.table_every}")
        check(self.trajectories_every >= 0, "trajectories_every", f"must be >= 0 (0: off), got {self.trajectories_every}")
        check("wandb" not in self.backends or bool(self.wandb_project), "wandb_project", "must be set for the wandb backend")

    def trajectories_due(self, step: int) -> bool:
        """Whether trajectories of ``step`` (1-based) are to be saved."""
        return self.trajectories_every > 0 and step % self.trajectories_every == 0
