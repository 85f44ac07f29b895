"""What a run tells about its directory at start: the resolved config written there, and where its
metrics and checkpoints go and how to watch it. Shared by every job (RL, reward model)."""

from __future__ import annotations

import atexit
import dataclasses
import os
from pathlib import Path

import yaml

from tidal.config_base import ConfigError
from tidal.distributed.runtime import Runtime
from tidal.trainer import checkpoint as ckpt
from tidal.trainer.config import CheckpointConfig
from tidal.trainer.resume import ResumePoint, resolve_resume_point
from tidal.trainer.run_lock import RunLock, acquire_run_lock


@dataclasses.dataclass(kw_only=True)
class RunDir:
    """What a run holds of its directory: its lock (released when the run ends, or at exit) and the
    checkpoint it resumes from (None for a fresh run)."""

    lock: RunLock
    resume: ResumePoint | None


def claim_run_dir(output_dir: str, checkpoint: CheckpointConfig, runtime: Runtime, *,
                  required_keys: tuple[str, ...] = ckpt.TRAINER_STATE_KEYS) -> RunDir:
    """:func:`open_run_dir`, then the resume point (resolved once; a bad ``checkpoint.resume`` is a
    ConfigError here, before anything is loaded)."""
    saves = checkpoint.every > 0 or checkpoint.at_end
    lock = open_run_dir(output_dir, runtime, checkpoints=saves)
    try:
        resume = resolve_resume_point(checkpoint, output_dir, runtime, required_keys=required_keys)
    except BaseException:
        lock.release()
        raise
    atexit.register(lock.release)
    return RunDir(lock=lock, resume=resume)


def open_run_dir(output_dir: str, runtime: Runtime, *, checkpoints: bool) -> RunLock:
    """Claim the run directory for this run, before anything is written into it (a collective):
    rank 0 takes its exclusive lock (a second run in the same directory gets a ConfigError naming
    the first; every rank raises it), then partial saves are settled and the directory (and the
    checkpoint directory when ``checkpoints``) probed for writing. The caller releases the lock
    when the run ends."""
    lock, error = None, None
    if runtime.is_main:
        try:
            lock = acquire_run_lock(output_dir, runtime.rank)
        except ConfigError as e:
            error = e
    refused = runtime.broadcast_object(None if error is None else (error.key, error.message))
    if refused is not None:
        raise ConfigError(*refused)
    lock = lock or acquire_run_lock(output_dir, runtime.rank)  # a non-owning lock on the other ranks
    try:
        ckpt.settle_and_probe(output_dir, rank=runtime.rank, checkpoints=checkpoints, barrier=runtime.barrier)
    except BaseException:
        lock.release()
        raise
    return lock


def announce_run_dir(cfg) -> None:
    """Write the resolved config (the root ``TidalConfig``) into the run directory as
    ``config.yaml`` and say where the run lives and how to watch it (call on the main rank)."""
    run_dir = Path(cfg.run.output_dir)
    config_path = run_dir / "config.yaml"
    tmp = config_path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, config_path)
    lines = [f"[tidal] run directory: {run_dir}", f"[tidal]   resolved config: {config_path}"]
    if "jsonl" in cfg.logging.backends:
        lines.append(f"[tidal]   metrics: {run_dir / 'metrics.jsonl'}")
    if cfg.checkpoint.every > 0 or cfg.checkpoint.at_end:
        lines.append(f"[tidal]   checkpoints: {ckpt.checkpoint_root(cfg.run.output_dir)}")
    watch = [f"tidal report {run_dir}"]
    if "tensorboard" in cfg.logging.backends:
        watch.insert(0, f"tensorboard --logdir {run_dir / 'tb'}")
    lines.append(f"[tidal]   watch: {'  |  '.join(watch)}")
    print("\n".join(lines), flush=True)
