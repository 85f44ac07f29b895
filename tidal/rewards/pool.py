"""The worker processes of a reward function under ``isolation: process`` (and ``tidal serve-reward``).

Contract of :class:`WorkerPool`: ``await pool.call(path, arg, batched, timeout_s)`` always returns,
with ``("ok", value)`` / ``("error", message)`` (what :func:`~tidal.rewards.worker.call_in_worker`
gives, or why the call could not run) or ``("timeout", None)`` past ``timeout_s`` (the worker is
killed and replaced). Whatever the function or its argument does, the pool stays usable:

- the argument is pickled here, before it is scheduled: one that cannot be (a value nested too
  deeply, an unpicklable object) is that call's error; pebble's scheduler thread, which pickles the
  tasks, would otherwise die of it and leave a pool that fails every later call;
- a worker that ends while it runs a call is that call's error at once, whatever its exit code
  (pebble takes a worker that exits with code 0 -- ``posix._exit(0)``, ctypes' ``_exit`` -- for a
  clean exit, and its call would wait out its whole limit);
- a pool that breaks anyway (pebble's threads died: every call raises) or does not answer a call
  within its limit plus a worker's start-up is replaced by a new one, with a warning.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import sys
import threading
import time
from typing import Any

import pebble
from pebble.pool import process as _pebble

from tidal.rewards.worker import call_in_worker

# What a worker needs beyond a call's limit to start (spawn + importing the function's module).
WORKER_START_S = 60.0
_CLAIM_S = 2.0  # how long a worker that ended with code 0 waits to be matched with the call it had taken


class _WorkerManager(_pebble.WorkerManager):
    def inspect_workers(self) -> tuple:
        """Every worker that ended, with its exit code (pebble's drops those that ended with 0)."""
        ended = tuple(w for w in _pebble.dictionary_values(self.workers) if not w.is_alive())
        for w in ended:
            if w.pid is not None:
                self.workers.pop(w.pid)
        return tuple((w.pid, w.exitcode) for w in ended)


class _PoolManager(_pebble.PoolManager):
    def __init__(self, context, mp_context):
        super().__init__(context, mp_context)
        self.worker_manager = _WorkerManager(context.workers, context.worker_parameters, mp_context)
        self._unclaimed: dict[int, float] = {}  # pid of a worker that ended with 0 -> when it was seen

    def handle_worker_expiration(self, expiration: tuple) -> None:
        worker_id, exitcode = expiration
        if exitcode != 0:
            return super().handle_worker_expiration(expiration)
        self._unclaimed.setdefault(worker_id, time.monotonic())  # its call's acknowledgement may still be in the pipe

    def update_workers(self) -> None:
        super().update_workers()
        running = {t.worker_id: t for t in _pebble.dictionary_values(self.task_manager.tasks) if t.worker_id}
        for pid, seen in list(self._unclaimed.items()):
            if pid in running:
                error = _pebble.ProcessExpired("Abnormal termination (exit code 0 while running a call)", code=0, pid=pid)
                self.task_manager.task_done(running[pid].id, _pebble.Result(_pebble.ResultStatus.ERROR, error))
            elif time.monotonic() - seen < _CLAIM_S:
                continue
            del self._unclaimed[pid]


class _ProcessPool(pebble.ProcessPool):
    """pebble's pool whose manager notices a worker that ends with code 0 while it runs a call."""

    def __init__(self, max_workers: int, context):
        super().__init__(max_workers=max_workers, context=context)
        self._pool_manager = _PoolManager(self._context, context)


class WorkerPool:
    """``concurrency`` spawned worker processes for the function at ``label`` (see the module docstring)."""

    def __init__(self, workers: int, *, label: str):
        self.workers, self.label = workers, label
        self._pool: _ProcessPool | None = None
        self._lock = threading.Lock()

    def _get(self, broken: _ProcessPool | None = None, why: str = "") -> _ProcessPool:
        """The live pool; with ``broken``, that one is replaced first (unless another call did already)."""
        with self._lock:
            if broken is not None and self._pool is broken:
                print(f"[tidal] warning: the worker pool of reward function '{self.label}' {why}; starting a new one",
                      file=sys.stderr, flush=True)
                self._pool = None
                broken.stop()
                threading.Thread(target=broken.join, args=(10,), daemon=True).start()
            if self._pool is None:
                self._pool = _ProcessPool(self.workers, multiprocessing.get_context("spawn"))
            return self._pool

    async def call(self, path: str, arg: Any, batched: bool, timeout_s: float) -> tuple[str, Any]:
        try:
            payload = pickle.dumps(arg)
        except BaseException as e:  # noqa: BLE001 -- RecursionError, PicklingError, TypeError, ...: this call's error
            return "error", f"cannot be handed to a worker process ({type(e).__name__}: {str(e)[:200]})"
        pool = self._get()
        try:
            fut = pool.schedule(call_in_worker, args=(path, payload, batched), timeout=timeout_s)
        except RuntimeError as e:  # pebble's "Unexpected error within the Pool" / "The Pool is not active"
            pool = self._get(pool, f"is broken ({e})")
            fut = pool.schedule(call_in_worker, args=(path, payload, batched), timeout=timeout_s)
        waited = asyncio.wrap_future(fut)
        try:
            done, _ = await asyncio.wait({waited}, timeout=timeout_s + WORKER_START_S)
        except asyncio.CancelledError:
            fut.cancel()  # pebble ends the worker that runs it
            raise
        if not done:
            fut.cancel()
            self._get(pool, f"did not answer a call within its limit + {WORKER_START_S:g} s")
            return "error", f"the worker pool did not answer within timeout_s={timeout_s:g} + {WORKER_START_S:g} s; it was replaced"
        try:
            return waited.result()
        except TimeoutError:  # pebble's limit: the worker was killed
            return "timeout", None
        except _pebble.ProcessExpired as e:
            return "error", f"worker process died ({e}; exit code {e.exitcode})"
        except _pebble.BrokenProcessPool as e:
            self._get(pool, f"is broken ({e})")
            return "error", f"the worker pool broke ({e}); it was replaced"

    async def aclose(self) -> None:
        """Stop the workers; idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            await asyncio.to_thread(pool.join, 10)

    def live_pids(self) -> set[int]:
        """The pids of the live workers (for tests and diagnostics)."""
        return set(self._pool._pool_manager.worker_manager.workers) if self._pool is not None else set()
