"""Where a built-in task's assets live and how they are built: once, atomically.

A task's assets are a folder ``{workdir}/{name}-{hash of the settings}/`` holding a completion
marker (``task.json``, written last) beside what the task builds. Each task says how to build its
folder; this module owns the folder's name, the marker and the atomic build. Assets are built in a
sibling temporary directory and renamed into place, so a directory that exists is complete.
A build of several phases keeps each finished phase in ``{workdir}/.{name}-{hash}.phases/`` until
the folder is complete, so a build stopped by Ctrl-C (:class:`BuildStopped`) continues from its
last finished phase when rerun. Concurrent builders (e.g. every rank of a torchrun job) each build and the first rename wins; call
it on one rank and barrier to avoid duplicate work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from tidal.config_base import ConfigError, to_dict

MARKER = "task.json"
BUILD_VERSION = 3  # part of the asset hash: bump whenever the same settings would build different assets
# Where and how fast to build do not change the assets; the other task's section is not this task's.
_NOT_SETTINGS = ("workdir", "sft_threads", "calculator")


class BuildStopped(Exception):
    """A task build stopped by SIGINT (Ctrl-C); its finished phases are kept for the next build."""

    def __init__(self, root: Path):
        kept = sorted(p.name for p in phases_dir(root).glob("*") if not p.name.startswith("."))
        what = f"its finished phase(s) {', '.join(kept)} are kept in {phases_dir(root)}" if kept else "no phase had finished"
        super().__init__(f"stopped by SIGINT while building the task {root.name}; {what}: rerun the same command to continue")


@dataclasses.dataclass(kw_only=True, frozen=True)
class TaskAssets:
    """Paths of a built task. model_path holds both tokenizer and model; sft_accuracy is the greedy
    held-out accuracy of the warm-started model (fraction of eval rows correct)."""

    model_path: str
    train_path: str
    eval_path: str
    sft_accuracy: float


def settings_hash(cfg) -> str:
    settings = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_SETTINGS}
    settings["build_version"] = BUILD_VERSION
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def asset_dir(cfg: Any, workdir: str) -> Path:
    """The folder of the task ``cfg`` (a task section with a ``name``) under ``workdir``."""
    return Path(workdir).expanduser() / f"{cfg.name}-{settings_hash(cfg)}"


def phases_dir(root: Path) -> Path:
    """Where the build of ``root`` keeps its finished phases until ``root`` is complete (then removed)."""
    return root.parent / f".{root.name}.phases"


def ensure_built(cfg: Any, root: Path, build: Callable[[Any, Path], None], *, key: str = "workdir") -> Path:
    """``root``, built first by ``build(cfg, tmp_dir)`` (atomically) unless a complete build is
    there; a folder of that name without the marker is a config error at ``key``."""
    if not (root / MARKER).is_file():
        if root.exists():
            raise ConfigError(key, f"{root} exists but has no {MARKER}; it was not built by Tidal, remove it")
        _build_atomically(cfg, root, build)
    return root


def built(cfg: Any, workdir: str, build: Callable[[Any, Path, Path], None]) -> TaskAssets:
    """The assets of ``cfg`` under ``workdir`` (:func:`ensure_built`); ``build(cfg, out, phases)``
    keeps its finished phases under ``phases`` (:func:`phases_dir`)."""
    root = asset_dir(cfg, workdir)
    root = ensure_built(cfg, root, lambda c, out: build(c, out, phases_dir(root)))
    marker = json.loads((root / MARKER).read_text())
    return TaskAssets(
        model_path=str(root / "model"),
        train_path=str(root / "train.jsonl"),
        eval_path=str(root / "eval.jsonl"),
        sft_accuracy=marker["sft_accuracy"],
    )


def _build_atomically(cfg, root: Path, build: Callable[[Any, Path], None]) -> None:
    """Run ``build(cfg, tmp_dir)`` in a sibling temporary directory and rename it to ``root``."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the assets are meant to be shared
    try:
        build(cfg, tmp)
        os.rename(tmp, root)
    except OSError:
        if not (root / MARKER).is_file():  # not a lost race with another builder
            raise
    except KeyboardInterrupt:
        raise BuildStopped(root) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(phases_dir(root), ignore_errors=True)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
