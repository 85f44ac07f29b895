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

from tidal.files import open_regular
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
        self._f = open_regular(self.path, "a", what="metrics file", encoding="utf-8")

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
    the file atomically. The file is read a line at a time (it may be long) and only when it is a
    regular file: a named pipe, a device or a directory there is a ValueError saying what it is."""
    if not os.path.lexists(path):
        return
    tmp = path.with_suffix(".jsonl.tmp")
    changed = False
    try:
        with open_regular(path, "rb", what="metrics file") as src, open(tmp, "wb") as out:
            number, line = 0, None
            for following in src:  # one line behind the reader: the last line may be torn
                if line is not None:
                    changed |= not _keep(path, number, line, start_step, out, last=False)
                number, line = number + 1, following
            if line is not None:
                changed |= not _keep(path, number, line, start_step, out, last=True)
        if changed:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _keep(path: Path, number: int, raw: bytes, start_step: int, out, *, last: bool) -> bool:
    """Write line ``number`` of the metrics file to ``out`` when its record is at most ``start_step``
    (a fresh run, ``start_step`` 0, keeps nothing: its step 0 is written anew); whether it was kept
    as it was (a last line without its newline gets one)."""
    line = raw.decode("utf-8", errors="replace")
    step = _record_step(path, number, line, last=last) if start_step > 0 and line.strip() else None
    if step is None or step > start_step:
        return False
    out.write(raw if raw.endswith(b"\n") else raw + b"\n")
    return raw.endswith(b"\n")


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
