"""Stage watchdog: which stage every rank is in, and a report instead of a silent hang.

Every rank records where it is: :meth:`Watchdog.set_step` at the start of each step,
:meth:`Watchdog.stage` around a block (every timed phase of the trainer goes through
:class:`StageTimer`), :meth:`Watchdog.mark` for a stage lasting until the next event. A rank's
*position* is ``(step, k)``: its k-th stage event (an entry or an exit) of that step. Ranks run the
same stages in the same order (SPMD), so ranks in step have equal positions.

With several ranks, a daemon thread on every rank writes its position to
``<run_dir>/heartbeat/rank<R>.json`` whenever it changed (checked every ``flush_s`` <= 1 s, so the
training thread never waits on the filesystem), and rank 0's thread reads every rank's file every ``poll_s``. When positions
differ and the most advanced ranks have been at theirs for ``timeout_s`` (``run.collective_timeout_s``)
less three polls -- they wait in a collective the others never entered -- it prints a
report naming every rank's step and stage and the ranks that are behind, writes it to
``<run_dir>/heartbeat/divergence.json`` and ends the process with :data:`EXIT_CODE`, so torchrun
stops (or, with ``--max-restarts``, restarts) the job instead of it hanging until the backend's own
timeout (the report comes before ``timeout_s`` is over, so before the backend's timeout of the same
length fires without naming stages). A rank that wrote no heartbeat within ``timeout_s`` of the start is reported the same way.
An exception leaving a stage (such as gloo's own collective timeout) gets the report as a note.

Does not know what the stages do; enters one collective, in :meth:`start` (all ranks, once), and
none afterwards. ``<run_dir>`` must be visible to every rank (as checkpoints already require).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tidal.lazy import lazy_module
from tidal.logging.timer import PhaseTimer
from tidal.run import faults

dist = lazy_module("torch.distributed")
if TYPE_CHECKING:
    from tidal.distributed.runtime import Runtime

EXIT_CODE = 3


class Watchdog:
    def __init__(self, *, rank: int, world_size: int, run_dir: str | Path, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.poll_s = min(10.0, max(0.05, self.timeout_s / 20))
        self.flush_s = min(1.0, self.poll_s)
        self.deadline_s = self.timeout_s - 3 * self.poll_s  # heartbeat lag + poll lag stay within timeout_s
        self.dir = Path(run_dir) / "heartbeat"
        self.session = ""
        self.step = 0
        self._k = 0
        self._state = self._make_state("start", "in")
        self._written: dict | None = None
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- recording (training thread) ------------------------------------------------------------
    def _make_state(self, stage: str, state: str) -> dict:
        return {
            "rank": self.rank, "session": self.session, "pid": os.getpid(), "step": self.step, "k": self._k,
            "stage": stage, "state": state, "entered": time.time(),
        }

    def _event(self, stage: str, state: str) -> None:
        self._k += 1
        self._state = self._make_state(stage, state)  # replaced whole: the thread reads a consistent dict

    def set_step(self, step: int) -> None:
        self.step, self._k = step, 0
        self._state = self._make_state("step start", "in")
        faults.set_step(step)

    def mark(self, name: str) -> None:
        """This rank is now in stage ``name`` (until the next event)."""
        self._event(name, "in")
        faults.hit(f"stage/{name}", step=self.step, rank=self.rank)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Block in stage ``name``; an exception leaving it gets a note naming the stage of every rank."""
        self.mark(name)
        try:
            yield
        except BaseException as e:
            if not getattr(e, "_tidal_stage_noted", False):
                e.add_note(self.describe(f"rank {self.rank} failed in step {self.step}, stage '{name}'"))
                e._tidal_stage_noted = True
            raise
        self._event(name, "done")

    # ---- heartbeat thread -------------------------------------------------------------------------
    def start(self, runtime: Runtime) -> "Watchdog":
        """Collective (all ranks, once): agree on a session id, write the first heartbeat, start the thread."""
        if self.world_size == 1:
            return self
        self.session = runtime.broadcast_object(f"{time.time():.6f}-{os.getpid()}")
        self._state = {**self._state, "session": self.session}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write(self._state)
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="tidal-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; the heartbeat says this rank finished (rank 0 stops comparing)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        self._write({**self._state, "state": "closed"})

    def _run(self) -> None:
        last_check = time.monotonic()
        while not self._stop.wait(self.flush_s):
            state = self._state
            if state is not self._written:
                with contextlib.suppress(OSError):  # a full disk must not end the watchdog
                    self._write(state)
            if self.rank == 0 and time.monotonic() - last_check >= self.poll_s:
                last_check = time.monotonic()
                report = self.check()
                if report is not None:
                    self._fire(report)

    def _path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.json"

    def _write(self, state: dict) -> None:
        tmp = self._path(self.rank).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._path(self.rank))
        self._written = state

    def _read(self, rank: int) -> dict | None:
        """Rank ``rank``'s heartbeat of this session (this rank's own from memory), or None."""
        if rank == self.rank:
            return self._state
        try:
            beat = json.loads(self._path(rank).read_text())
        except (OSError, ValueError):
            return None
        return beat if beat.get("session") == self.session else None

    # ---- divergence -----------------------------------------------------------------------------
    def check(self, now: float | None = None) -> dict | None:
        """A divergence report when ranks have been at different positions for > timeout_s, else None."""
        now = time.time() if now is None else now
        beats = {r: self._read(r) for r in range(self.world_size)}
        if any(b is not None and b["state"] == "closed" for b in beats.values()):
            return None  # the run is ending
        missing = [r for r, b in beats.items() if b is None]
        if missing:
            if now - self._started <= self.deadline_s:
                return None
            return self._report(beats, now, behind=missing, why=f"ranks {missing} wrote no heartbeat")
        pos = {r: (b["step"], b["k"]) for r, b in beats.items()}
        top = max(pos.values())
        ahead = [r for r, p in pos.items() if p == top]
        if len(ahead) == self.world_size:
            return None
        waited = now - max(beats[r]["entered"] for r in ahead)
        if waited <= self.deadline_s:
            return None
        behind = [r for r in pos if r not in ahead]
        return self._report(beats, now, behind=behind, why=f"ranks {ahead} waited {waited:.1f} s for ranks {behind}")

    def _report(self, beats: dict, now: float, *, behind: list[int], why: str) -> dict:
        ranks = []
        for r, b in sorted(beats.items()):
            if b is None:
                ranks.append({"rank": r, "stage": None, "behind": True})
            else:
                ranks.append({
                    "rank": r, "step": b["step"], "stage": b["stage"], "state": b["state"],
                    "seconds": round(now - b["entered"], 3), "behind": r in behind,
                })
        return {"timeout_s": self.timeout_s, "why": why, "behind": behind, "ranks": ranks}

    def _fire(self, report: dict) -> None:
        text = format_report(report, "ranks diverged")
        print(text, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            (self.dir / "divergence.json").write_text(json.dumps(report, indent=1))
        from tidal.run.supervise import report_outcome

        report_outcome(EXIT_CODE)  # said above: the supervising command adds nothing
        os._exit(EXIT_CODE)

    def describe(self, headline: str) -> str:
        """Every rank's stage now (from the heartbeats), under ``headline``."""
        beats = {r: self._read(r) for r in range(self.world_size)}
        pos = {r: (b["step"], b["k"]) for r, b in beats.items() if b is not None}
        top = max(pos.values())
        behind = sorted(r for r in beats if r not in pos or pos[r] < top)
        return format_report(self._report(beats, time.time(), behind=behind, why=headline), "stage report")


def format_report(report: dict, title: str) -> str:
    lines = [f"[tidal.watchdog] {title}: {report['why']} (run.collective_timeout_s={report['timeout_s']:g})"]
    for r in report["ranks"]:
        if r["stage"] is None:
            lines.append(f"  rank {r['rank']}: no heartbeat  <- behind")
            continue
        where = "in" if r["state"] == "in" else "after"
        mark = "  <- behind" if r["behind"] else ""
        lines.append(f"  rank {r['rank']}: step {r['step']}, {where} stage '{r['stage']}' for {r['seconds']:.1f} s{mark}")
    if report["behind"]:
        lines.append(f"  diverged (behind): ranks {report['behind']}")
    return "\n".join(lines)


class StageTimer(PhaseTimer):
    """A :class:`PhaseTimer` whose every phase is also a watchdog stage of the same name."""

    def __init__(self, watchdog: Watchdog, **kwargs):
        super().__init__(**kwargs)
        self.watchdog = watchdog

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self.watchdog.stage(name), super().phase(name):
            yield
