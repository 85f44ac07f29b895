"""Progress of long steps (building a task's assets, the warm start, loading models and data,
evaluation, checkpoint saves, export) on the console, with rich.

On a terminal each step is a live line of one shared rich display (spinner, description, bar and
count when the total is known, elapsed and remaining time, a short info text), beside the run's step bar
(:class:`tidal.logging.console.ConsoleBackend`); rich allows one live display per console, so every
bar of the process is a task of the same :class:`Display`. When the output is not a terminal (a log
file, a pipe, a scheduler's capture) nothing is redrawn: a step still running after
``PLAIN_FIRST_S`` seconds prints a plain line saying so (with its count), another every
``PLAIN_EVERY_S`` seconds, and every step prints one line when it ends (with its time).

Remaining time: for a step with a count, its elapsed time over the units done times the units left
(``480/1,500 steps (32%) after 1 min 02 s, about 2 min 12 s left``); for a step without one, when
the caller knows how long the same step took before (``expected_s``: the previous evaluation), that
duration less the time spent (``about 8.0 s left (the last took 12.3 s)``).

Use :func:`stage` for a step without a count, or a :class:`Step` with ``total=`` advanced by hand; pass ``enabled=False`` on ranks other than the main one.
"""

from __future__ import annotations

import threading
import time
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PLAIN_FIRST_S = 2.0
PLAIN_EVERY_S = 30.0
PLAIN_WIDTH = 160  # lines written to a file are not wrapped at rich's default 80 columns
SPEED_WINDOW_S = 3600.0  # rich's remaining time: the rate over this window (an RL step may take minutes)
_console: Console | None = None
_displays: dict[int, "Display"] = {}


def console() -> Console:
    """The process's console on stdout (made once; wide and without colour when not a terminal)."""
    global _console
    if _console is None:
        c = Console()
        _console = c if c.is_terminal else Console(width=max(c.width, PLAIN_WIDTH), no_color=True, highlight=False)
    return _console


def display(con: Console | None = None) -> "Display":
    """The one live display of ``con`` (default: :func:`console`)."""
    con = con or console()
    if id(con) not in _displays:
        _displays[id(con)] = Display(con)
    return _displays[id(con)]


class Display:
    """The live progress display of one console: bars are added and removed as tasks; the live
    region runs while any task exists. ``print`` writes above it (or plainly when none runs)."""

    def __init__(self, con: Console):
        self.console = con
        self.live = con.is_terminal
        self._progress: Progress | None = None
        self._tasks = 0

    def add(self, description: str, *, total: float | None, completed: float = 0, info: str = "") -> TaskID | None:
        if not self.live:
            return None
        if self._progress is None:
            self._progress = Progress(
                SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=self.console,
                speed_estimate_period=SPEED_WINDOW_S,
            )
            self._progress.start()
        self._tasks += 1
        return self._progress.add_task(description, total=total, completed=completed, info=info)

    def update(self, task: TaskID | None, **kwargs) -> None:
        if task is not None and self._progress is not None:
            self._progress.update(task, **kwargs)

    def remove(self, task: TaskID | None) -> None:
        if task is None or self._progress is None:
            return
        self._progress.remove_task(task)
        self._tasks -= 1
        if self._tasks == 0:
            self._progress.stop()
            self._progress = None

    def print(self, renderable) -> None:
        con = self._progress.console if self._progress is not None else self.console
        if isinstance(renderable, str):  # plain text as is: "[tidal]" is not markup
            con.print(renderable, markup=False, highlight=False, soft_wrap=True)
        else:
            con.print(renderable)


class Step:
    """One long step on the console (see the module docstring); or made by :func:`stage`.

    ``advance(n, info=...)`` counts done units; ``info`` (e.g. ``loss 0.41``) is shown beside the
    bar and in the plain lines; ``done(info)`` sets what the final line says. Off a terminal a
    daemon thread prints the plain lines while the step runs: the first after ``PLAIN_FIRST_S``
    (a quick step prints only its final line), then one every ``PLAIN_EVERY_S``. ``expected_s``
    (a step without a count): how long the same step took last time, for its remaining time."""

    def __init__(self, description: str, *, total: int | None = None, unit: str = "", enabled: bool = True,
                 con: Console | None = None, expected_s: float | None = None):
        self.description = description
        self.total = total
        self.expected_s = expected_s
        self.unit = unit
        self.completed = 0
        self.info = ""
        self._display = display(con) if enabled else None
        self._task = None
        self._start = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Step":
        self._start = time.perf_counter()
        if self._display is None:
            return self
        if self._display.live:
            self._task = self._display.add(self.description, total=self.total, info=self._expected())
        else:
            self._thread = threading.Thread(target=self._plain_lines, daemon=True, name="tidal-progress")
            self._thread.start()
        return self

    def _plain_lines(self) -> None:
        wait = PLAIN_FIRST_S
        while not self._stop.wait(wait):
            self._display.print(f"[tidal] {self.description}: {self._count()}{self._elapsed()}{self._remaining()}{self._info()} ...")
            wait = PLAIN_EVERY_S

    def advance(self, n: int = 1, *, info: str | None = None) -> None:
        self.completed += n
        if info is not None:
            self.info = info
        if self._display is not None and self._display.live:
            self._display.update(self._task, completed=self.completed, info=self.info)

    def done(self, info: str) -> None:
        self.info = info

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._display is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._display.remove(self._task)
        if exc_type is None:
            self._display.print(f"[tidal] {self.description}: done in {self._elapsed()}{self._info()}")

    # ---- text --------------------------------------------------------------------------------------
    def _elapsed(self) -> str:
        return format_seconds(time.perf_counter() - self._start)

    def _count(self) -> str:
        """``480/1,500 steps (32%) after `` (or ``480 steps after ``, or ``after ``)."""
        unit = f" {self.unit}" if self.unit else ""
        if self.total is not None:
            return f"{self.completed:,}/{self.total:,}{unit} ({100 * self.completed / max(self.total, 1):.0f}%) after "
        return f"{self.completed:,}{unit} after " if self.completed else "after "

    def _remaining(self) -> str:
        """``, about 2 min 12 s left`` (see the module docstring), or nothing when unknown."""
        spent = time.perf_counter() - self._start
        if self.total is not None and 0 < self.completed <= self.total:
            left = spent / self.completed * (self.total - self.completed)
            return f", about {format_seconds(left)} left"
        if self.total is None and self.expected_s is not None:
            left = self.expected_s - spent
            return f", about {format_seconds(left)} left{self._expected(' (', ')')}" if left > 0 else \
                f", longer than the last{self._expected(' (', ')')}"
        return ""

    def _expected(self, before: str = "", after: str = "") -> str:
        return f"{before}the last took {format_seconds(self.expected_s)}{after}" if self.expected_s is not None else ""

    def _info(self) -> str:
        return f" ({self.info})" if self.info else ""


def stage(description: str, *, enabled: bool = True, con: Console | None = None, expected_s: float | None = None) -> Step:
    """A step without a count: ``with stage("loading model /m"): ...``; ``expected_s``: how long it
    took last time (its remaining time is shown)."""
    return Step(description, enabled=enabled, con=con, expected_s=expected_s)


def format_seconds(seconds: float) -> str:
    """``0.42 s``, ``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
