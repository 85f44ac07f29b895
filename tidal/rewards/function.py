"""Custom reward functions named by ``module:function``.

Contract of a reward function: ``fn(sample: RewardSample) -> number`` (``def`` or ``async def``);
with ``fn.batched = True``: ``fn(samples: list[RewardSample]) -> list[number]`` of the same length.

Whatever a function does -- return garbage, raise any exception (``SystemExit`` and
``KeyboardInterrupt`` included), or never return -- it is an error of its sample(s), never a hang
or the end of the caller. Every call has a time limit (``timeout_s``), counted in
``reward/<name>/timeouts_count`` when it runs out. Where the call runs is ``isolation``:

- ``thread`` (default): an ``async def`` function runs on the reward engine's event loop and is
  cancelled at its limit (at its next ``await``); a ``def`` function runs on a daemon thread of its
  own, and at its limit its sample is given up on, but Python cannot stop a thread, so the call
  keeps running in the background until it returns. Such overdue threads are bounded: while
  ``concurrency`` of them still run, no new call is started (each sample is an error saying why),
  so a function that hangs on every call cannot pile up threads until memory runs out.
  ``os._exit`` called by the function raises ``SystemExit`` in it (:func:`~tidal.rewards.worker.user_call`).
- ``process``: calls run in a pool of ``concurrency`` worker processes (:class:`~tidal.rewards.pool.WorkerPool`,
  ``pebble`` started with ``spawn``); a call past its limit is killed with its worker, which is
  replaced; a worker that ends mid-call (any exit code) is that sample's error at once; a broken
  pool is replaced. Arguments and results cross a process boundary (each call pays a pickling
  round trip; the function's module is imported once per worker). ``tidal serve-reward --function``
  always uses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from typing import Any, Callable

from tidal.rewards.base import AsyncComponent, ComponentResult
from tidal.rewards.config import FunctionRewardConfig
from tidal.rewards.pool import WORKER_START_S, WorkerPool
from tidal.rewards.types import RewardSample
from tidal.rewards.worker import UserBaseException, checked_value, describe, guarded, is_async, load_function, user_call

__all__ = ["FunctionReward", "load_function"]



def _start_daemon_call(fn: Callable[[Any], Any], arg: Any) -> concurrent.futures.Future:
    """Run ``fn(arg)`` on a new daemon thread (a hung call never blocks interpreter exit). A
    BaseException of ``fn`` is delivered as :class:`UserBaseException`: awaited on the event loop,
    a raw SystemExit would stop the loop itself."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            with user_call():
                value = fn(arg)
            fut.set_result(value)
        except Exception as e:  # delivered to the waiting coroutine
            fut.set_exception(e)
        except BaseException as e:  # noqa: BLE001 -- SystemExit / KeyboardInterrupt of the function
            fut.set_exception(UserBaseException(e))

    threading.Thread(target=run, name="tidal-reward-fn", daemon=True).start()
    return fut


class _TimedOut(Exception):
    pass


class FunctionReward(AsyncComponent):
    """A Python reward function as a component (see the module docstring)."""

    counter_names = ("timeouts",)

    def __init__(self, cfg: FunctionRewardConfig, *, key: str):
        self.cfg = cfg
        self.fn = load_function(cfg.path, f"{key}.path")  # imported here too: a bad path fails at start
        self.is_async = is_async(self.fn)
        self.batched = getattr(self.fn, "batched", False) is True
        self.streams = not self.batched  # a batched function sees the whole batch, as its author wrote it for
        self.label = cfg.path
        self._pool = None
        self._pool_lock = threading.Lock()
        self._overdue: set[concurrent.futures.Future] = set()  # def calls past their limit, still running on their threads

    # -- where a call runs ---------------------------------------------------------------------------

    def _get_pool(self) -> WorkerPool:
        with self._pool_lock:
            if self._pool is None:
                self._pool = WorkerPool(self.cfg.concurrency, label=self.label)
            return self._pool

    async def _call_in_process(self, arg: Any) -> tuple[str, Any]:
        status, value = await self._get_pool().call(self.cfg.path, arg, self.batched, self.cfg.timeout_s)
        if status == "timeout":
            raise _TimedOut()
        return status, value

    async def _call_in_thread(self, arg: Any) -> Any:
        try:
            if self.is_async:
                return await asyncio.wait_for(guarded(self.fn(arg)), self.cfg.timeout_s)
            fut = _start_daemon_call(self.fn, arg)
            try:
                return await asyncio.wait_for(asyncio.wrap_future(fut), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                self._overdue.add(fut)  # its thread runs on: counted until it returns
                raise
        except asyncio.TimeoutError:
            raise _TimedOut() from None

    def _thread_refused(self) -> str | None:
        """Why no new thread may start (``concurrency`` overdue calls still running), or None."""
        self._overdue = {f for f in self._overdue if not f.done()}
        if len(self._overdue) < self.cfg.concurrency:
            return None
        return (f"not started: {len(self._overdue)} earlier calls are still running past timeout_s={self.cfg.timeout_s:g} "
                f"on threads that cannot be stopped (at most concurrency={self.cfg.concurrency} of them); set isolation: "
                "process to have hung calls killed")

    async def _call(self, arg: Any) -> tuple[str, Any]:
        """``("ok", value)`` or ``("error", message)``; raises _TimedOut past the limit. ``value`` is
        checked (a float; per sample for a batched function) in the process that ran the call."""
        if self.cfg.isolation == "process":
            return await self._call_in_process(arg)
        if not self.is_async and (why := self._thread_refused()):
            return "error", why
        try:
            value = await self._call_in_thread(arg)
        except _TimedOut:
            raise
        except Exception as e:  # UserBaseException included
            return "error", describe(e)
        return checked_value(value, arg, self.batched)

    # -- scoring -------------------------------------------------------------------------------------

    def deadline_s(self, n: int) -> float:
        """The longest ``score_async`` of n samples can take under this function's own limits."""
        waves = 1 if self.batched else math.ceil(n / self.cfg.concurrency)
        return waves * self.cfg.timeout_s + (WORKER_START_S if self.cfg.isolation == "process" else 0.0)

    async def score_async(self, samples: list[RewardSample]) -> ComponentResult:
        if not samples:
            return ComponentResult(scores=[])
        if self.batched:
            return await self._score_batched(samples)
        sem = asyncio.Semaphore(self.cfg.concurrency)
        outcomes = await asyncio.gather(*(self._score_one(sem, s) for s in samples))
        result = ComponentResult(scores=[score for score, _, _ in outcomes], counters={"timeouts": 0.0})
        for i, (_score, err, timed_out) in enumerate(outcomes):
            if err is not None:
                result.errors[i] = err
            result.counters["timeouts"] += timed_out
        return result

    async def _score_one(self, sem: asyncio.Semaphore, sample: RewardSample) -> tuple[float, str | None, bool]:
        """(score, error or None, whether it timed out)."""
        async with sem:  # the time limit starts when the call starts, not while it queues
            try:
                status, value = await self._call(sample)
            except _TimedOut:
                return math.nan, f"timed out after {self.cfg.timeout_s:g} s in function '{self.label}'", True
        if status == "ok":
            return value, None, False
        return math.nan, f"function '{self.label}' {value}", False

    async def _score_batched(self, samples: list[RewardSample]) -> ComponentResult:
        n = len(samples)
        try:
            status, value = await self._call(list(samples))
        except _TimedOut:
            msg = f"timed out after {self.cfg.timeout_s:g} s in batched function '{self.label}' ({n} samples)"
            return ComponentResult.failed(n, msg, timeouts=1.0)
        if status != "ok":
            return ComponentResult.failed(n, f"batched function '{self.label}' {value}", timeouts=0.0)
        result = ComponentResult(scores=[], counters={"timeouts": 0.0})
        for i, (score, err) in enumerate(value):
            result.scores.append(math.nan if score is None else score)
            if err is not None:
                result.errors[i] = f"batched function '{self.label}' {err}"
        return result

    def needs_close(self) -> bool:
        return self._pool is not None

    async def aclose(self) -> None:
        """Stop the worker processes (process isolation); idempotent."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()
