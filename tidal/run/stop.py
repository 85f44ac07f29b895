"""Graceful stop on SIGINT / SIGTERM / SIGHUP: finish the step, agree, checkpoint, exit with :data:`EXIT_CODE`.

Schedulers send SIGTERM before they preempt a job (and torchrun forwards the signals it gets to its
workers); a terminal that closes (a dropped ssh session) sends SIGHUP. The first of these signals a
rank receives only sets a flag; after each step every rank
learns whether any rank was signalled (one host all-reduce), so all stop after the same step. The
trainer then saves a checkpoint of that step (when checkpoints are enabled) and raises
:class:`StopRun`, which the ``tidal`` command turns into exit code :data:`EXIT_CODE` (75,
EX_TEMPFAIL: "stopped, rerun to resume"). A second signal aborts at once (the default handler is
restored after the first), for when the step or the save takes too long.

Handlers are installed only in the main thread (Python's rule) and restored on exit.
"""

from __future__ import annotations

import signal
import threading

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

    def _handle(self, signum, _frame) -> None:
        self.signum = signum
        for sig in SIGNALS:  # a second signal takes the default way out
            signal.signal(sig, self._previous.get(sig, signal.SIG_DFL))

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
