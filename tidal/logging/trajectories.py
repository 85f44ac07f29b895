"""Saving rollout trajectories (prompt, response, rewards, logprobs) as JSONL, one file per step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to a trajectory file")


class TrajectoryWriter:
    """Writes ``RUN_DIR/trajectories/step_XXXXXX.jsonl`` (6-digit step), one record per line.

    Records are plain dicts; tensors and numpy values become lists. The file is written to a
    temporary name and renamed, so a reader never sees half a step. Call it on one rank (gather
    the records there first); a second write of the same step replaces the file.
    """

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "trajectories"

    def write(self, step: int, records: list[dict[str, Any]]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:06d}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, default=_jsonable) + "\n")
        os.replace(tmp, path)
        return path
