"""Graceful stop on SIGINT / SIGTERM / SIGHUP: finish the step, agree, checkpoint, exit with :data:`EXIT_CODE`.

Schedulers send SIGTERM before they preempt a job (and torchrun forwards the signals it gets to its
workers); a terminal that closes (a dropped ssh session) sends SIGHUP. The first of these signals a
rank receives only sets a flag; after each step every rank
learns whether any rank was signalled (one host all-reduce), so all stop after the same step. The
trainer then saves a checkpoint of that step (when checkpoints are enabled) and raises
:class:`StopRun`, which the ``tidal`` command turns into exit code :data:`EXIT_CODE` (75,
EX_TEMPFAIL: "stopped, rerun to resume"). A second signal aborts at once (by the handler that was
there before), for when the step or the save takes too long; but a copy of the first passed on by
the supervising ``tidal`` command within :data:`~tidal.run.supervise.REPEAT_S` of it is that signal,
not a second one (Slurm signals every process of a job step, the supervisor passes its copy on:
:mod:`tidal.run.supervise`). Two signals sent to this process itself always count as two.

Handlers are installed only in the main thread (Python's rule) and restored on exit.
"""

from __future__ import annotations

import signal
import threading
import time

from tidal.run import supervise

EXIT_CODE = 75
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRun(Exception):
    """The run stopped on a signal after the step ``step`` (saved when checkpoints are enabled)."""

    def __init__(self, step: int, signum: int, saved: bool):
        self.step, self.signum, self.saved = step, signum, saved
        what = f"checkpoint of step {step} saved; rerun the same command to resume" if saved else (
            f"after step {step}; no checkpoint (checkpoints are off)")
        super().__init__(f"stopped by {signal.Signals(signum).name}: {what}")


class StopRequest:
    """Context manager: while inside, the first SIGINT/SIGTERM/SIGHUP sets :attr:`signum` instead of killing."""

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}
        self._last = (0.0, False)  # (when, passed on by the supervisor) of the last signal

    def _handle(self, signum, _frame) -> None:
        now, passed_on = time.monotonic(), supervise.forwarded()
        if not self.signum:
            self.signum, self._last = signum, (now, passed_on)
            return
        then, was_passed_on = self._last
        if now - then < supervise.REPEAT_S and (passed_on or was_passed_on):
            self._last = (now, True)
            return  # the same signal come another way (module docstring)
        for sig in SIGNALS:  # a second signal takes the way out that was there before
            signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))
        signal.raise_signal(signum)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
