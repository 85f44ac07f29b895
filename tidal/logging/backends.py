"""Metrics backends: each writes one logged step's ``{key: float}`` somewhere.

Contract: a backend is built with ``(cfg, run_dir, total_steps=, start_step=, hparams=)`` on the
main rank only, gets ``write(step, metrics)`` for each logged step in increasing order (step 0:
the start of the run, its evaluation before training, :meth:`MetricsLogger.log_start`), and
``close()`` once. ``start_step`` is the last step already done (0 for a fresh run): anything a
backend had recorded after it (a crashed run's tail) is discarded so a resumed run's record is
continuous. Backends never reduce across ranks; values arrive already reduced.
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Protocol

from tidal.logging.config import LoggingConfig
from tidal.optional_deps import OPTIONAL, require
from tidal.registry import Registry

BACKENDS: Registry["MetricsBackend"] = Registry("logging backend")


class MetricsBackend(Protocol):
    def __init__(self, cfg: LoggingConfig, run_dir: Path, *, total_steps: int, start_step: int, hparams: dict | None): ...

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


@BACKENDS.register("jsonl")
class JsonlBackend:
    """``RUN_DIR/metrics.jsonl``: ``{"step": N, key: value, ...}`` per line; non-finite values as null."""

    def __init__(self, cfg, run_dir, *, total_steps, start_step, hparams):
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, start_step)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, step, metrics):
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self):
        self._f.close()


def _record_step(path: Path, number: int, line: str, *, last: bool) -> int | None:
    """The step of one metrics record; None for a torn last line (a crash or a full disk cut the
    write short), which is dropped with a warning naming the file; ValueError naming the file and
    line for any other line that is not a record."""
    try:
        record = json.loads(line)
        return int(record["step"])
    except (ValueError, KeyError, TypeError):
        if last:
            print(f"[tidal] warning: {path}:{number}: the last line is not a whole record (a write cut short by a "
                  "crash or a full disk); dropping it", file=sys.stderr, flush=True)
            return None
        raise ValueError(f"{path}:{number} is not a metrics record ({line[:80]!r}); repair or move that file") from None


def _truncate_after(path: Path, start_step: int) -> None:
    """Drop records with step > start_step (a crashed run's tail) and a torn last line, rewriting
    the file atomically."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    # a fresh run (start_step 0) keeps nothing: its step 0 (the start-of-run evaluation) is written anew
    kept = []
    if start_step > 0:
        for i, ln in enumerate(lines):
            step = _record_step(path, i + 1, ln, last=i == len(lines) - 1) if ln.strip() else None
            if step is not None and step <= start_step:
                kept.append(ln if ln.endswith("\n") else ln + "\n")
    if kept != lines:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)


@BACKENDS.register("tensorboard")
class TensorBoardBackend:
    """Scalars under ``RUN_DIR/tb``; on resume, events after ``start_step`` are purged."""

    def __init__(self, cfg, run_dir, *, total_steps, start_step, hparams):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        if hparams and not start_step:
            self._w.add_text("config", "```\n" + json.dumps(hparams, indent=2, default=str) + "\n```", 0)

    def write(self, step, metrics):
        for key, value in metrics.items():
            self._w.add_scalar(key, value, step)
        self._w.flush()

    def close(self):
        self._w.close()


def require_package(backend: str) -> None:
    """A ConfigError at ``logging.backends`` naming the install command when the package of
    ``backend`` (tensorboard, wandb) is missing (:mod:`tidal.optional_deps`)."""
    if backend in OPTIONAL:
        require(backend, "logging.backends", f"logging backend '{backend}'")


@BACKENDS.register("wandb")
class WandbBackend:
    """A W&B run in ``RUN_DIR/wandb``; its id is kept in ``RUN_DIR/wandb_run_id`` so a resumed run continues it."""

    def __init__(self, cfg, run_dir, *, total_steps, start_step, hparams):
        import wandb

        id_file = run_dir / "wandb_run_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:16])
        self._run = wandb.init(
            project=cfg.wandb_project,
            mode=cfg.wandb_mode,
            dir=str(run_dir),
            name=run_dir.name,
            id=id_file.read_text().strip(),
            resume="allow",
            config=hparams,
        )

    def write(self, step, metrics):
        self._run.log(dict(metrics), step=step)

    def close(self):
        self._run.finish()


def make_backend(name: str, cfg: LoggingConfig, run_dir: Path, **kwargs: Any) -> MetricsBackend:
    return BACKENDS.get(name, "logging.backends")(cfg, run_dir, **kwargs)
