"""An exclusive lock on a run directory: two runs writing one ``output_dir`` corrupt each other's
metrics and checkpoints, so the second one must stop at start with an error naming the first.

The lock is the file ``<run_dir>/.tidal.lock`` holding its owner as JSON: ``pid``, ``host``, the
process's start time (``start_ticks`` from ``/proc/<pid>/stat``, so a reused pid is not mistaken for
the owner), ``started`` (wall time), ``argv`` and a random ``token``. It is created atomically with
its content (written to a private file, then hard-linked to the lock's name, which fails if the
name exists), so two runs starting at once cannot both get it, and a reader never sees half a lock.

A lock whose owner is gone is *stale* and is taken over: on the same host, when no process has
that pid (or one has it but started at another time). On another host liveness cannot be checked,
so the error says which host and pid hold it and which file to delete if that run is dead; except
after an elastic restart: a lock written by an earlier attempt of the same torchrun job (the same
``TORCHELASTIC_RUN_ID``, a lower ``TORCHELASTIC_RESTART_COUNT``: ``elastic`` in the lock) is stale
on any host, since torch's agents stopped every rank of that attempt before they restarted the job
(a lost node's rank 0 included), so the job comes back on the nodes left.

Contract: only rank 0 takes the lock (``acquire_run_lock(run_dir, rank)`` returns a lock that owns
nothing on other ranks); the caller makes the ranks agree on the outcome (this module runs no
collective). ``release()`` removes the file only while it still holds this lock's token.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tidal.config_base import ConfigError

LOCK_NAME = ".tidal.lock"


class RunDirLost(RuntimeError):
    """The run directory (with its lock) was removed or replaced while the run wrote into it
    (:meth:`tidal.run.run_dir.RunDir.check_intact`)."""


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _start_ticks(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "argv": sys.argv[:8], "token": secrets.token_hex(8),
            "elastic": _elastic()}


def _elastic() -> dict[str, Any] | None:
    """This process's torchrun job and attempt (``{"run_id", "restart"}``), None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    try:
        return {"run_id": run_id, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    except ValueError:
        return None


def _earlier_attempt(owner: dict[str, Any]) -> bool:
    """The lock was taken by an earlier attempt of this torchrun job (restarted since)."""
    mine, theirs = _elastic(), owner.get("elastic")
    return (mine is not None and isinstance(theirs, dict) and theirs.get("run_id") == mine["run_id"]
            and isinstance(theirs.get("restart"), int) and theirs["restart"] < mine["restart"])


def _describe(owner: dict[str, Any]) -> str:
    cmd = " ".join(str(a) for a in owner.get("argv") or [])
    return (f"pid {owner.get('pid')} on host {owner.get('host')!r} since {owner.get('started')}"
            + (f" ({cmd[:120]})" if cmd else ""))


class RunLock:
    """A held (or, on ranks other than 0, a non-owning) lock; a context manager that releases it."""

    def __init__(self, path: Path, owner: dict[str, Any] | None):
        self.path = path
        self.owner = owner  # None: this lock owns nothing (rank != 0, or released)

    @property
    def held(self) -> bool:
        return self.owner is not None

    def release(self) -> None:
        """Remove the lock file if it is still this lock's (idempotent)."""
        if self.owner is None:
            return
        current = _read(self.path)
        if isinstance(current, dict) and current.get("token") == self.owner["token"]:
            self.path.unlink(missing_ok=True)
        self.owner = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: Path) -> dict[str, Any] | None | str:
    """The owner in ``path``; None if there is no lock; a string saying why it cannot be read."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int) or not isinstance(data.get("host"), str):
        return "unreadable (not a Tidal run lock)"
    return data


def _stale(owner: dict[str, Any]) -> bool:
    """The owner is certainly gone (same host, and no process with its pid and start time), or is
    this very process: a process runs one run at a time, so its earlier lock on the directory
    (a run built and not released, e.g. in a notebook) is over; or an earlier attempt of this
    torchrun job (:func:`_earlier_attempt`, any host)."""
    if _earlier_attempt(owner):
        return True
    if owner["host"] != socket.gethostname():
        return False
    pid = owner["pid"]
    if pid == os.getpid():
        return True
    if not _pid_alive(pid):
        return True
    ticks = owner.get("start_ticks")
    now = _start_ticks(pid)
    return ticks is not None and now is not None and now != ticks  # the pid was reused


def _try_create(path: Path, owner: dict[str, Any]) -> bool:
    """Create ``path`` holding ``owner`` atomically; False if it already exists."""
    tmp = path.with_name(f"{path.name}.{owner['pid']}.{owner['token']}.tmp")
    tmp.write_text(json.dumps(owner))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _take_over(path: Path, seen: dict[str, Any]) -> None:
    """Move a stale lock aside, only if it is still the one judged stale (another starting run may
    have taken it over already: then the next create attempt sees that run's lock)."""
    aside = path.with_name(f"{path.name}.stale.{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    moved = _read(aside)
    if isinstance(moved, dict) and moved.get("token") != seen.get("token"):
        try:  # not the stale one: put it back (at worst it is gone and its owner re-checks nothing)
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


def held_by_another_run(run_dir: str | os.PathLike) -> bool:
    """Whether the lock of ``run_dir`` may belong to a live run (an unreadable lock, or another
    host's, counts as one): while it may, nothing in the directory is another run's to clean up."""
    owner = _read(Path(run_dir) / LOCK_NAME)
    return owner is not None and (isinstance(owner, str) or not _stale(owner))


def acquire_run_lock(run_dir: str | os.PathLike, rank: int, *, key: str = "run.output_dir") -> RunLock:
    """Take the run directory's lock on rank 0 (see the module docstring); on other ranks return a
    non-owning lock. Raises ConfigError at ``key`` naming the run that holds it."""
    path = Path(run_dir) / LOCK_NAME
    if rank != 0:
        return RunLock(path, None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(key, f"cannot create {path.parent}: {e.strerror or e}") from None
    me = _me()
    for _ in range(5):  # a stale lock taken over by another starting run: look again
        try:
            if _try_create(path, me):
                return RunLock(path, me)
        except OSError as e:
            raise ConfigError(key, f"cannot create the run lock {path}: {e.strerror or e}") from None
        owner = _read(path)
        if owner is None:
            continue  # released meanwhile
        if isinstance(owner, str):
            raise ConfigError(key, f"{path} is {owner}; if no run uses {path.parent}, delete that file")
        if not _stale(owner):
            where = "" if owner["host"] == socket.gethostname() else f"; if that run is dead, delete {path}"
            raise ConfigError(key, f"{path.parent} is in use by another run: {_describe(owner)}. "
                              f"Wait for it to end or choose another run.output_dir{where}")
        why = ("an earlier attempt of this job, restarted by torchrun" if _earlier_attempt(owner)
               else "that process is gone")
        print(f"[tidal] warning: taking over the stale run lock of {_describe(owner)} ({why})", file=sys.stderr, flush=True)
        _take_over(path, owner)
    raise ConfigError(key, f"could not take the run lock {path}: other runs keep taking it over")
