"""Figures: one JSON line each on stdout, kept for the record file, where each line is stamped with
the run id, time, commit, device and the run's settings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import uuid

GIB = 2**30
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Recorder:
    """Prints figures and appends them, stamped, to ``record_path`` (when given) at :meth:`write`."""

    def __init__(self, *, commit: str, record_path: str | None, settings: dict):
        self.run_id = uuid.uuid4().hex[:12]
        self.commit = commit
        self.record_path = record_path
        self.settings = settings
        self.device: str | None = None
        self.figures: list[dict] = []

    def emit(self, figure: str, *, record: bool = True, **fields) -> dict:
        """Print one figure (floats to 4 significant digits); ``record``: also for the record file."""
        rec = rounded({"figure": figure, **fields})
        print(json.dumps(rec, default=str), flush=True)
        if record:
            self.figures.append(rec)
        return rec

    def stamp(self) -> dict:
        return {"run_id": self.run_id, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": self.commit,
                "device": self.device, "settings": self.settings}

    def write(self) -> None:
        """Append every recorded figure, stamped, to the record file (no-op without one)."""
        if not self.record_path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.record_path)), exist_ok=True)
        stamp = self.stamp()
        with open(self.record_path, "a") as f:
            for rec in self.figures:
                f.write(json.dumps({**stamp, **rec}, default=str) + "\n")


def rounded(x, digits: int = 4):
    """Floats to ``digits`` significant digits, recursively (keeps the printed lines short)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


def gib(x):
    return None if x is None else round(x / GIB, 3)


def git_commit() -> str:
    """``$TIDAL_COMMIT`` (the GPU machine has no .git), else the checkout's short hash."""
    if os.environ.get("TIDAL_COMMIT"):
        return os.environ["TIDAL_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"
