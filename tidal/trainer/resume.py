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
from tidal.trainer import checkpoint as ckpt
from tidal.trainer.config import CheckpointConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumePoint:
    path: Path
    step: int


def resolve_resume_point(cfg: CheckpointConfig, output_dir: str, runtime: Runtime) -> ResumePoint | None:
    """The checkpoint to resume from (a collective: rank 0 settles partial saves, all ranks wait).
    A bad ``checkpoint.resume`` is a ConfigError naming it."""
    root = ckpt.checkpoint_root(output_dir)
    if runtime.is_main:
        ckpt.clean_partial(root)
    runtime.barrier()
    path = ckpt.resolve_resume(cfg.resume, root)
    if path is None:
        return None
    with open(path / ckpt.COMPLETE_MARKER) as f:
        return ResumePoint(path=path, step=int(json.load(f)["step"]))
