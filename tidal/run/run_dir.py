"""What a run tells about its directory: at start, the resolved config written there, and where its
metrics and checkpoints go and how to watch it; at the end, the next steps (report, eval, export
with the run's real paths). Shared by every job (RL, reward model)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import shlex
from pathlib import Path

import yaml

from tidal.config_base import ConfigError
from tidal.distributed.runtime import Runtime
from tidal.files import not_regular
from tidal.run import checkpoint as ckpt
from tidal.run.config import CheckpointConfig
from tidal.run.resume import ResumePoint, resolve_resume_point
from tidal.run.run_lock import RunDirLost, RunLock, acquire_run_lock, held_by_another_run


@dataclasses.dataclass(kw_only=True)
class RunDir:
    """What a run holds of its directory: its lock (released when the run ends, or at exit), the
    checkpoint it resumes from (None for a fresh run), and the directory as claimed (its absolute
    ``path`` and ``identity``, device and inode, on this rank)."""

    lock: RunLock
    resume: ResumePoint | None
    path: Path
    identity: tuple[int, int]

    def check_intact(self, runtime: Runtime) -> None:
        """Collective: :class:`RunDirLost` on every rank when, on any rank, the directory is gone,
        is another one now (removed and made again: a save would quietly recreate it), or lost the
        run's lock file. Metrics and checkpoints written into it since would be lost."""
        if not runtime.all_agree(self._intact()):
            raise RunDirLost(f"the run directory {self.path} was removed or replaced during the run (its lock file "
                             f"{self.lock.path.name} is gone); what the run wrote there since is lost. Stopping: "
                             "restore it, or start again")

    def _intact(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity and self.lock.path.exists()


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
    st = os.stat(output_dir)
    return RunDir(lock=lock, resume=resume, path=Path(output_dir).resolve(), identity=(st.st_dev, st.st_ino))


def open_run_dir(output_dir: str, runtime: Runtime, *, checkpoints: bool) -> RunLock:
    """Claim the run directory for this run, before anything is written into it (a collective):
    a directory inside another run's checkpoint is refused (its ``config.yaml`` would change the
    checkpoint); rank 0 takes its exclusive lock (partial saves settled first when no live run holds it: a save
    that filled the disk leaves no room for the lock's file; a second run in the same directory
    gets a ConfigError naming the first; every rank raises it), then partial saves are settled and
    the directory (and the checkpoint directory when ``checkpoints``) probed for writing. The caller releases the lock
    when the run ends."""
    lock, error = None, None
    if runtime.is_main:
        try:
            check_output_dir(output_dir)
            ckpt.check_outside_checkpoints(output_dir, key="run.output_dir")
            check_run_files(output_dir)
            if not held_by_another_run(output_dir):  # a save that filled the disk leaves no room for the lock file
                ckpt.clean_partial(ckpt.checkpoint_root(output_dir))
            lock = acquire_run_lock(output_dir, runtime.rank)
        except ConfigError as e:
            error = e
        except OSError as e:  # settling the partial saves failed: every rank says so
            error = ConfigError("run.output_dir", f"cannot settle the partial saves in {output_dir}: {e}")
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


SYSTEM_TREES = ("/proc", "/sys", "/dev")  # the kernel's files: no place for a run's


def check_output_dir(output_dir: str, key: str = "run.output_dir") -> None:
    """ConfigError at ``key`` when ``output_dir`` is no place for a run's files (its config.yaml,
    metrics.jsonl, checkpoints/, lock): the root folder, a folder inside ``/proc``, ``/sys`` or
    ``/dev``, an existing file, the home folder or a folder holding it, or a folder holding ``.ssh/``
    (someone's home). ``tidal check`` and every run check it before anything is written."""
    target = Path(output_dir).expanduser().resolve()
    home = Path.home().resolve()
    tree = next((t for t in SYSTEM_TREES if target == Path(t) or Path(t) in target.parents), None)
    if target == Path(target.anchor):
        why = "is the root folder"
    elif tree is not None:
        why = f"is inside {tree}, the kernel's files"
    elif os.path.lexists(target) and not target.is_dir():
        why = f"is {not_regular(target) or 'a file'}, not a folder"
    elif target == home:
        why = "is your home folder"
    elif target in home.parents:
        why = "holds your home folder"
    elif (target / ".ssh").is_dir():
        why = "holds .ssh/, as a home folder does"
    else:
        return
    raise ConfigError(key, f"{output_dir} {why}: a run writes its config.yaml, metrics.jsonl, checkpoints/ and lock there; "
                           "choose a folder of its own (e.g. runs/NAME)")


RUN_FILES = ("config.yaml", "metrics.jsonl")  # what a run rewrites or appends to in its directory


def check_run_files(output_dir: str) -> None:
    """ConfigError at ``run.output_dir`` when a file a run writes in its directory (:data:`RUN_FILES`)
    is there but is no regular file: a named pipe would block the run forever, ``/dev/full`` read
    whole fill memory, a directory fail deep in a write. Said before anything loads."""
    for name in RUN_FILES:
        path = Path(output_dir) / name
        found = not_regular(path) if os.path.lexists(path) else None
        if found is not None:
            raise ConfigError("run.output_dir", f"{path} is {found}, not a regular file: the run writes its {name} there; "
                                                "move it away, or choose another run.output_dir")


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


def next_steps(cfg, config: str, overrides: list[str]) -> list[str]:
    """What to do with a finished run, as commands with its real paths (``cfg``: the root
    ``TidalConfig``; ``config`` and ``overrides``: the command line's, repeated so that eval and
    export rebuild the same run): its report, and with a saved checkpoint the last one's eval and
    export (to a folder beside the run directory, never into it)."""
    run_dir = Path(cfg.run.output_dir)
    same = shlex.join([config, *overrides])
    lines = ["[tidal] next steps:", f"[tidal]   tidal report {shlex.quote(str(run_dir))}    # curves and summary: report.png, report.html"]
    saved = ckpt.complete_checkpoints(ckpt.checkpoint_root(cfg.run.output_dir))
    if not saved:
        lines.append("[tidal]   (no checkpoint was saved: set checkpoint.at_end=true or checkpoint.every=N to evaluate or export one)")
        return lines
    last = shlex.quote(str(saved[-1]))
    out = shlex.quote(str(run_dir.parent / f"{run_dir.name}_hf"))
    lines += [f"[tidal]   tidal eval {same} --checkpoint {last}    # held-out metrics of the last checkpoint",
              f"[tidal]   tidal export {same} --checkpoint {last} --out {out}    # a Hugging Face folder"]
    return lines
