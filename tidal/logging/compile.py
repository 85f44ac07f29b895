"""What ``torch.compile`` costs a run: compile time as its own metric, a console message while it
runs, and recompiles in steady state counted.

:class:`CompileMonitor` listens to dynamo's compile callbacks (``torch._dynamo.callback``: one
start/end pair around each compilation, the lazily compiled backward graphs included; nested
compilations count once). Compilation happens inside the phases that trigger it (the first
experience forwards, the first update), so ``time/compile`` is part of those phases' times, not
added to them.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class CompileMonitor:
    """Times compilations and reports them per iteration (see the module docstring).

    ``notify(message)``: called (on the compiling thread) when the first compilation of an iteration
    starts, and for every compilation after the first iteration (a recompile in steady state, which
    should not happen: shapes are bucketed and graphs are dynamic). ``cache_dir``: where compiled
    artifacts are kept (:func:`tidal.strategy.compile_cache.use_compile_cache`), named in the message.

    Use: ``install()`` once, ``pop()`` after each iteration, ``remove()`` at the end.
    """

    def __init__(self, notify: Callable[[str], None] = print, *, cache_dir: str | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.notify = notify
        self.cache_dir = cache_dir
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self._seconds = 0.0
        self._graphs = 0
        self._recompiles = 0
        self._iterations = 0  # pops so far: compilations after the first are recompiles
        self._announced = False
        self._installed = False

    def install(self) -> "CompileMonitor":
        from torch._dynamo.callback import callback_handler

        if not self._installed:
            callback_handler.register_start_callback(self._on_start)
            callback_handler.register_end_callback(self._on_end)
            self._installed = True
        return self

    def remove(self) -> None:
        from torch._dynamo.callback import callback_handler

        if self._installed:  # (``torch._dynamo.reset()`` drops every callback: nothing to remove then)
            if self._on_start in callback_handler.start_callbacks:
                callback_handler.remove_start_callback(self._on_start)
            if self._on_end in callback_handler.end_callbacks:
                callback_handler.remove_end_callback(self._on_end)
            self._installed = False

    def _on_start(self, *args) -> None:  # args: CallbackArgs on recent torch, none on older
        with self._lock:
            self._started = self._clock()
            steady = self._iterations > 0
            announce = not self._announced or steady
            self._announced = True
        if not announce:
            return
        if steady:
            what = getattr(args[0], "compile_id", "?") if args else "?"
            self.notify(f"[tidal] torch.compile: recompiling in steady state (compile id {what}); run with TORCH_LOGS=recompiles to see why")
        else:
            where = f"; compiled artifacts are cached in {self.cache_dir}, so later runs start faster" if self.cache_dir else ""
            self.notify(f"[tidal] torch.compile: compiling the model's layers (first iteration{where}) ...")

    def _on_end(self, *args) -> None:
        with self._lock:
            if self._started is None:
                return
            self._seconds += self._clock() - self._started
            self._started = None
            self._graphs += 1
            self._recompiles += self._iterations > 0

    def pop(self) -> dict[str, float]:
        """``time/compile`` (seconds compiling since the last pop), ``compile/graphs`` (compilations
        since the last pop) and ``compile/recompiles`` (compilations after the first iteration, for
        the whole run); marks the end of an iteration."""
        with self._lock:
            out = {"time/compile": self._seconds, "compile/graphs": float(self._graphs), "compile/recompiles": float(self._recompiles)}
            self._seconds, self._graphs = 0.0, 0
            self._iterations += 1
            self._announced = False
        return out

    def __enter__(self) -> "CompileMonitor":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()
