"""Where a run resumes from: resolved once, at setup, before anything is loaded.

``checkpoint.resume`` (``auto``, ``never`` or a path) is turned into a :class:`ResumePoint` (the
checkpoint directory and its step) or None for a fresh run. What an interrupted save left is settled
first (rank 0; the others wait), so a put-back ``step_N.old`` is the step that the logger keeps its
records up to and the one the trainer loads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tidal.distributed.runtime import Runtime
from tidal.run import checkpoint as ckpt
from tidal.run.config import CheckpointConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumePoint:
    path: Path
    step: int


def resolve_resume_point(cfg: CheckpointConfig, output_dir: str, runtime: Runtime, *,
                         required_keys: tuple[str, ...] = ckpt.TRAINER_STATE_KEYS) -> ResumePoint | None:
    """The checkpoint to resume from (a collective; partial saves are settled before, by
    :func:`tidal.run.run_dir.open_run_dir`). Under ``auto`` the newest checkpoint that passes the
    cheap checks (:func:`tidal.run.checkpoint.checkpoint_problems`) is taken, every rank agreeing;
    a bad explicit ``checkpoint.resume`` is a ConfigError naming what is wrong."""
    root = ckpt.checkpoint_root(output_dir)
    path = ckpt.resolve_resume(cfg.resume, root, runtime=runtime, required_keys=required_keys)
    if path is None:
        return None
    with open(path / ckpt.COMPLETE_MARKER) as f:
        return ResumePoint(path=path, step=int(json.load(f)["step"]))
