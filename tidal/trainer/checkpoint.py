"""Atomic, rotated, sharded checkpoints (torch.distributed.checkpoint) and exact resume.

Layout: ``<output_dir>/checkpoints/step_000010/`` holding the DCP shards of every trained model and
its optimizer + scheduler, ``trainer.json`` (step, sampler and algorithm state) and ``rng_rank<R>.pt``
(every RNG of each rank). A checkpoint is written into ``step_000010.tmp`` and renamed only when
every rank has finished: a crash mid-save leaves the previous checkpoint as the newest complete
one, and the partial ``.tmp`` directory is removed at the next save or resume. With several nodes
``output_dir`` must be on a filesystem every node sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tidal.config_base import ConfigError
from tidal.trainer import faults

COMPLETE_MARKER = "trainer.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and (p / COMPLETE_MARKER).is_file()]
    return [p for _, p in sorted(found)]


def clean_partial(root: Path) -> list[str]:
    """Settle what an interrupted save left (rank 0 only): remove ``*.tmp`` directories; a
    ``step_N.old`` (an interrupted re-save of step N) is put back when ``step_N`` is missing,
    else removed. Returns the names removed or put back."""
    removed = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.endswith(".tmp") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
            elif p.name.endswith(".old") and p.is_dir():
                final = p.with_name(p.name[: -len(".old")])
                if final.exists():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.rename(final)
                removed.append(p.name)
    return removed


def check_writable(directory: Path, *, rank: int, key: str = "run.output_dir") -> None:
    """Create ``directory`` and write, fsync and remove a probe file in it, so that an unwritable
    run or checkpoint directory fails at start (ConfigError at ``key`` naming it), not at the first
    save hours later. Every rank probes (each writes its own shards)."""
    probe = directory / f".write_probe_rank{rank}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"tidal")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise ConfigError(key, f"cannot write to {directory}: {type(e).__name__}: {e.strerror or e}") from None


def checkpoint_bytes(models: list[torch.nn.Module]) -> int:
    """About what one checkpoint takes: fp32 trainable weights plus AdamW's two fp32 moments."""
    return sum(12 * p.numel() for m in models for p in m.parameters() if p.requires_grad)


def check_free_space(directory: Path, need_bytes: int, *, key: str = "run.output_dir") -> None:
    """ConfigError at ``key`` when ``directory``'s filesystem has less than ``need_bytes`` free
    (a new checkpoint is written before the oldest is rotated out)."""
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise ConfigError(
            key, f"{directory} has {free / 2**30:.2f} GiB free but a checkpoint needs about {need_bytes / 2**30:.2f} GiB; "
            "free disk space, point run.output_dir elsewhere or disable checkpoints (checkpoint.every=0, checkpoint.at_end=false)",
        )


def rng_state() -> dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path, step: int, *, model_states: dict[str, Any], trainer_state: dict[str, Any], rank: int, keep: int
) -> Path:
    """Collective: every rank calls it with its shards. Returns the final directory."""
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        clean_partial(root)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace atomically below
            shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    faults.hit("checkpoint/begin", step=step, rank=rank)
    dcp.save(model_states, checkpoint_id=str(tmp / "models"))
    faults.hit("checkpoint/shards", step=step, rank=rank)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        with open(tmp / COMPLETE_MARKER, "w") as f:
            json.dump(trainer_state, f)
            f.flush()
            os.fsync(f.fileno())
        faults.hit("checkpoint/marker", step=step, rank=rank)
        if final.exists():
            final.rename(final.with_name(final.name + ".old"))
            faults.hit("checkpoint/swapped", step=step, rank=rank)
        tmp.rename(final)
        faults.hit("checkpoint/renamed", step=step, rank=rank)
        shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
        _fsync_dir(root)
        for old in complete_checkpoints(root)[:-keep]:
            trash = old.rename(old.with_name(old.name + ".del.tmp"))  # a half-deleted one never looks complete
            faults.hit("checkpoint/rotating", step=step, rank=rank)
            shutil.rmtree(trash, ignore_errors=True)
    dist.barrier()
    return final


def resolve_resume(resume: str, root: Path) -> Path | None:
    """The checkpoint to resume from: ``auto`` -> newest complete one (or None), ``never`` -> None,
    else the given directory (which must be complete)."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise ConfigError("checkpoint.resume", f"{resume!r} is not a complete Tidal checkpoint (no {COMPLETE_MARKER})")
    return path


def load_checkpoint(path: Path, *, model_states: dict[str, Any], rank: int) -> dict[str, Any]:
    """Load shards into ``model_states`` in place (collective); restore this rank's RNG; return trainer state."""
    dcp.load(model_states, checkpoint_id=str(path / "models"))
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    with open(path / COMPLETE_MARKER) as f:
        return json.load(f)
