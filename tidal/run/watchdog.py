"""Stage watchdog: which stage every rank is in, and a report instead of a silent hang.

Every rank records where it is: :meth:`Watchdog.set_step` at the start of each step,
:meth:`Watchdog.stage` around a block (every timed phase of the trainer goes through
:class:`StageTimer`), :meth:`Watchdog.mark` for a stage lasting until the next event. A rank's
*position* is ``(step, k)``: its k-th stage event (an entry or an exit) of that step. Ranks run the
same stages in the same order (SPMD), so ranks in step have equal positions.

With several ranks, a daemon thread on every rank writes its position to
``<run_dir>/heartbeat/rank<R>.json`` whenever it changed (checked every ``flush_s`` <= 1 s, so the
training thread never waits on the filesystem), and at least every ``beat_s`` with the time of writing
(``beat``) even when it did not, so with several nodes a rank whose process or node is gone shows as
*silent* (on one node torchrun's agent sees a dead rank and stops the others). Rank 0's
thread reads every rank's file every ``poll_s``. When positions
differ and the most advanced ranks have been at theirs for ``timeout_s`` (``run.collective_timeout_s``)
less three polls -- they wait in a collective the others never entered -- it prints a
report naming every rank's step and stage and the ranks that are behind, writes it to
``<run_dir>/heartbeat/divergence.json`` and ends the process with :data:`EXIT_CODE`, so torchrun
stops (or, with ``--max-restarts``, restarts) the job instead of it hanging until the backend's own
timeout (the report comes before ``timeout_s`` is over, so before the backend's timeout of the same
length fires without naming stages). A rank that wrote no heartbeat within ``timeout_s`` of the start is reported the same way.
An exception leaving a stage (such as gloo's own collective timeout) gets the report as a note.
With several nodes (a :class:`~tidal.distributed.topology.Topology`) the report names each rank's
node and host, and the hosts of the ranks behind: a node that died shows as its ranks' missing or
stalled heartbeats. Then, too, the first rank of every node (not rank 0 alone) looks for ranks gone
silent, so a lost node 0 is reported by the others; and a collective's error (a plain
``RuntimeError`` from gloo, a ``torch.distributed.DistError``: what a collective raises when a peer's
connection closes) waits ``4 * beat_s`` for ranks that are gone to show as silent: when some are,
the node is lost, and the rank ends with :data:`EXIT_CODE` and the report (``ranks lost``, naming
the silent ranks' node and host) instead of raising the connection's error (exit code 1). One
report per session: the lowest surviving rank reports at once, another a few beats later unless a
report of this session is in ``divergence.json`` by then (it ends quietly).

Does not know what the stages do; enters one collective, in :meth:`start` (all ranks, once), and
none afterwards. ``<run_dir>`` must be visible to every rank (as checkpoints already require).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
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
    from tidal.distributed.topology import Topology

EXIT_CODE = 3


class Watchdog:
    def __init__(self, *, rank: int, world_size: int, run_dir: str | Path, timeout_s: float, topology: Topology | None = None):
        self.rank = rank
        self.world_size = world_size
        self.topology = topology if topology is not None and topology.num_nodes > 1 else None
        self.timeout_s = float(timeout_s)
        self.poll_s = min(10.0, max(0.05, self.timeout_s / 20))
        self.flush_s = min(1.0, self.poll_s)
        self.beat_s = max(self.flush_s, min(2.0, self.poll_s))  # a rank silent for 3 beats is gone
        self.deadline_s = self.timeout_s - 3 * self.poll_s  # heartbeat lag + poll lag stay within timeout_s
        self.dir = Path(run_dir) / "heartbeat"
        self.session = ""
        self.step = 0
        self._k = 0
        self._state = self._make_state("start", "in")
        self._written: dict | None = None
        self._beat = 0.0  # when this rank last wrote its heartbeat
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ending = threading.Lock()  # held by the one thread that ends the process (_fire)

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
            self.note(e, f"rank {self.rank} failed in step {self.step}, stage '{name}'")
            raise
        self._event(name, "done")

    def note(self, e: BaseException, headline: str) -> None:
        """Add the stage report (:meth:`describe`) to ``e`` as a note, once. With several nodes, for
        a collective's error (a plain ``RuntimeError`` from gloo, a ``DistError``) it first waits for
        ranks that are gone to show as silent (:meth:`_await_silence`)."""
        if getattr(e, "_tidal_stage_noted", False):
            return
        if self.topology is not None and is_collective_error(e):  # a peer's node may be gone
            if self._reported():
                _exit()  # a rank reported a lost node (its exit may be what failed this collective)
            self._await_silence()
            self._end_if_lost(e, headline)
        e.add_note(self.describe(headline))
        e._tidal_stage_noted = True

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
            if state is not self._written or time.time() - self._beat >= self.beat_s:
                with contextlib.suppress(OSError):  # a full disk must not end the watchdog
                    self._write(state)
            if self._checks() and time.monotonic() - last_check >= self.poll_s:
                last_check = time.monotonic()
                report = self.check(gone_only=self.rank != 0)
                if report is not None:
                    self._fire(report, "ranks lost" if report.get("lost") else "ranks diverged")

    def _checks(self) -> bool:
        """Whether this rank's thread checks the others: rank 0 (for everything), and with several
        nodes the first rank of every other node (for ranks gone silent: a lost node 0)."""
        if self.rank == 0:
            return True
        return self.topology is not None and self.topology.nodes[self.topology.node_of(self.rank)][0] == self.rank

    def _path(self, rank: int) -> Path:
        return self.dir / f"rank{rank}.json"

    def _write(self, state: dict) -> None:
        tmp = self._path(self.rank).with_suffix(".json.tmp")
        self._beat = time.time()
        tmp.write_text(json.dumps({**state, "beat": self._beat}))
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
    def check(self, now: float | None = None, *, gone_only: bool = False) -> dict | None:
        """A divergence report when ranks have been at different positions for > timeout_s, or (with
        ``lost`` true) when ranks have been silent for that long, else None; ``gone_only``: only the latter."""
        now = time.time() if now is None else now
        beats = {r: self._read(r) for r in range(self.world_size)}
        if any(b is not None and b["state"] == "closed" for b in beats.values()):
            return None  # the run is ending
        missing = [r for r, b in beats.items() if b is None]
        if missing:
            if now - self._started <= self.deadline_s or gone_only:
                return None
            return self._report(beats, now, behind=missing, why=f"ranks {missing} wrote no heartbeat")
        gone = [r for r in self._silent(beats, now) if now - beats[r]["beat"] > self.deadline_s]
        if gone:
            return {**self._report(beats, now, behind=gone, why=self._gone_why(beats, gone, now)), "lost": True}
        if gone_only:
            return None
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

    def _silent(self, beats: dict, now: float) -> list[int]:
        """Ranks (not this one) whose heartbeat is older than three beats: their thread stopped. Only
        with several nodes: on one node torchrun's agent sees a dead rank itself and stops the rest."""
        if self.topology is None:
            return []
        return [r for r, b in beats.items()
                if b is not None and r != self.rank and b.get("state") != "closed" and now - b.get("beat", now) > 3 * self.beat_s]

    def _gone_why(self, beats: dict, gone: list[int], now: float) -> str:
        return (f"ranks {gone}{self._where(gone)} wrote no heartbeat for {now - max(beats[r]['beat'] for r in gone):.1f} s "
                "(their processes or node are gone)")

    def _where(self, ranks: list[int]) -> str:
        """`` on node 1 (host b)`` for ranks of known nodes, else empty."""
        if self.topology is None:
            return ""
        nodes = sorted({self.topology.node_of(r) for r in ranks})
        return " on " + ", ".join(f"node {g} (host {self.topology.hosts[g]})" for g in nodes)

    def _report(self, beats: dict, now: float, *, behind: list[int], why: str) -> dict:
        ranks = []
        for r, b in sorted(beats.items()):
            where = {"node": self.topology.node_of(r), "host": self.topology.host_of(r)} if self.topology else {}
            if b is None:
                ranks.append({"rank": r, **where, "stage": None, "behind": True})
            else:
                ranks.append({
                    "rank": r, **where, "step": b["step"], "stage": b["stage"], "state": b["state"],
                    "seconds": round(now - b["entered"], 3), "behind": r in behind,
                    "silent": round(now - b.get("beat", now), 3) if r != self.rank else 0.0,
                })
        return {"timeout_s": self.timeout_s, "beat_s": self.beat_s, "why": why, "behind": behind, "ranks": ranks}

    def _fire(self, report: dict, title: str = "ranks diverged") -> None:
        """Print ``report`` under ``title``, write it to ``divergence.json`` and end the process with
        :data:`EXIT_CODE`; a second thread getting here waits for the first to end it."""
        if not self._ending.acquire(blocking=False):
            threading.Event().wait()  # another thread of this rank is ending the process
        with contextlib.suppress(OSError):
            (self.dir / "divergence.json").write_text(json.dumps({**report, "session": self.session}, indent=1))
        print(format_report(report, title), file=sys.stderr, flush=True)
        _exit()

    def _reported(self) -> bool:
        """Whether a rank has written its report of this session (``divergence.json``)."""
        try:
            return json.loads((self.dir / "divergence.json").read_text()).get("session") == self.session
        except (OSError, ValueError, AttributeError):
            return False

    def _end_if_lost(self, e: BaseException, headline: str) -> None:
        """After a collective's error: when ranks are silent (gone), end the process with the report
        (once per session: a rank that finds another's report ends quietly); else return. The lowest
        surviving rank reports at once; another waits ``4 * beat_s`` more, its heartbeat going on,
        for that report (the lowest may be blocked in a collective with this rank, not with the lost
        ones), or for its agent to stop it, before it reports itself."""
        cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        report = self._lost_report(headline, f"the collective's error: {cause}")
        if report is None:
            return
        if self.rank != min(r for r in range(self.world_size) if r not in report["behind"]):
            self._await_report(4 * self.beat_s)
            report = self._lost_report(headline, f"the collective's error: {cause}") or report
        if self._reported():
            _exit()  # said by another rank
        self._fire(report, "ranks lost")

    def _await_report(self, seconds: float) -> None:
        """Wait up to ``seconds`` for another rank's report of this session, or for this rank's agent
        to stop it (SIGTERM, SIGINT: another rank's exit ended the job)."""
        stopped: list[int] = []
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, lambda signum, _frame: stopped.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            end = time.monotonic() + seconds
            while not stopped and time.monotonic() < end and not self._reported():
                time.sleep(min(0.1, self.poll_s))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _lost_report(self, headline: str, tail: str) -> dict | None:
        """The report of the ranks silent now (gone), or None when none is."""
        now = time.time()
        beats = {r: self._read(r) for r in range(self.world_size)}
        gone = self._silent(beats, now)
        if not gone:
            return None
        why = f"{headline}: {self._gone_why(beats, gone, now)}; {tail}"
        return {**self._report(beats, now, behind=gone, why=why), "lost": True}

    def describe(self, headline: str) -> str:
        """Every rank's stage now (from the heartbeats), under ``headline``; silent ranks are behind
        and named with their node and host."""
        now = time.time()
        beats = {r: self._read(r) for r in range(self.world_size)}
        pos = {r: (b["step"], b["k"]) for r, b in beats.items() if b is not None}
        top = max(pos.values())
        silent = self._silent(beats, now)
        behind = sorted(r for r in beats if r not in pos or pos[r] < top or r in silent)
        if silent:
            headline += f"; ranks {silent}{self._where(silent)} wrote no heartbeat for {now - max(beats[r]['beat'] for r in silent):.1f} s"
        return format_report(self._report(beats, now, behind=behind, why=headline), "stage report")

    def _await_silence(self) -> None:
        """Give ranks that are gone the time to show as silent (3 beats and one more), for a note."""
        if self._thread is not None:
            time.sleep(4 * self.beat_s)


def _exit() -> None:
    """End the process with :data:`EXIT_CODE`, its cause said (the supervising command adds nothing)."""
    from tidal.run.supervise import report_outcome

    report_outcome(EXIT_CODE)
    os._exit(EXIT_CODE)


def is_collective_error(e: BaseException) -> bool:
    """What a collective raises when it fails (a peer gone, a timeout): gloo's plain ``RuntimeError``,
    ``torch.distributed.DistError`` (NCCL's, the store's)."""
    return type(e) is RuntimeError or isinstance(e, dist.DistError)


def format_report(report: dict, title: str) -> str:
    lines = [f"[tidal.watchdog] {title}: {report['why']} (run.collective_timeout_s={report['timeout_s']:g})"]
    for r in report["ranks"]:
        who = f"rank {r['rank']}" + (f" (node {r['node']}, host {r['host']})" if "node" in r else "")
        if r["stage"] is None:
            lines.append(f"  {who}: no heartbeat  <- behind")
            continue
        where = "in" if r["state"] == "in" else "after"
        mark = "  <- behind" if r["behind"] else ""
        quiet = f", no heartbeat for {r['silent']:.1f} s" if r.get("silent", 0.0) > 3 * report.get("beat_s", 1e9) else ""
        lines.append(f"  {who}: step {r['step']}, {where} stage '{r['stage']}' for {r['seconds']:.1f} s{quiet}{mark}")
    if report["behind"]:
        hosts = sorted({(r["node"], r["host"]) for r in report["ranks"] if r["behind"] and "node" in r})
        on = f" on {', '.join(f'node {g} (host {h})' for g, h in hosts)}" if hosts else ""
        lines.append(f"  {'lost' if report.get('lost') else 'diverged (behind)'}: ranks {report['behind']}{on}")
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
