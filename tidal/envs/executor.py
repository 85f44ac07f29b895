"""The pool that runs environment calls (``reset``/``step``, and so their tools) off the rollout loop.

The rollout loop submits a call and goes back to decoding; :meth:`StepPool.collect` hands back
the calls that finished and those that ran past ``env.step_timeout_s`` (a TimeoutError outcome).
At most ``env.workers`` calls run at once; the others wait in order, and a call's time limit starts
when it starts running, so calls queued behind slow or hung ones keep their whole limit. A call past
its limit is given up on and its slot goes to the next call, but Python cannot stop its thread: the
thread runs on until the call returns (tools bound their own calls, so this needs a broken
environment).

Threads are reused: a thread whose call returned waits up to ``IDLE_S`` for the next one, so
steady traffic starts no thread per call (``Thread.start`` waits until the OS runs the new thread,
milliseconds on a loaded machine, and the loop pays it on its own thread between engine steps). A
thread given up on joins the idle ones only once its call returns.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
import queue
import threading
import time
from typing import Any, Callable, Hashable

IDLE_S = 5.0  # how long a pool thread waits for its next call before it ends


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A finished call: ``value`` when ``error`` is None, else the exception it raised (a
    TimeoutError when it ran past its limit)."""

    key: Hashable
    value: Any = None
    error: BaseException | None = None


@dataclasses.dataclass
class _Call:
    key: Hashable
    run: Callable[[], Any]
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    deadline: float = math.inf  # monotonic time its limit ends; inf while it waits for a slot


class StepPool:
    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s, self.workers = timeout_s, workers
        self._queued: collections.deque[_Call] = collections.deque()
        self._running: list[_Call] = []
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of threads waiting for a call
        self._closed = False

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        self._queued.append(_Call(key, functools.partial(fn, *args)))
        self._start_queued()

    def __len__(self) -> int:
        return len(self._queued) + len(self._running)

    def collect(self, *, block: bool, timeout: float | None = None) -> list[Outcome]:
        """Outcomes of the finished calls and of those past their deadline. ``block``: wait until
        there is at least one (when any call is pending), or at most ``timeout`` seconds when given."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self._harvest()
            if out or not block or not len(self):
                return out
            wake = min(c.deadline for c in self._running)  # calls wait only while every slot is taken
            if give_up is not None:
                if time.monotonic() >= give_up:
                    return out
                wake = min(wake, give_up)
            concurrent.futures.wait([c.future for c in self._running], timeout=max(0.0, wake - time.monotonic()),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _start_queued(self) -> None:
        while self._queued and len(self._running) < self.workers:
            call = self._queued.popleft()
            call.deadline = time.monotonic() + self.timeout_s
            self._running.append(call)
            with self._lock:
                inbox = self._idle.pop() if self._idle else None
            if inbox is not None:
                inbox.put(call)
            else:
                threading.Thread(target=self._serve, args=(call,), name="tidal-env", daemon=True).start()

    def _serve(self, call: _Call | None) -> None:
        """A pool thread: run ``call``, then the calls handed to it while it waits (at most
        ``IDLE_S`` between two); it ends when none comes or the pool shuts down."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        while call is not None:
            _run(call)
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)
            try:
                call = inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nothing handed over: end
                        self._idle.remove(inbox)
                        return
                call = inbox.get()  # handed over as the wait ended

    def _harvest(self) -> list[Outcome]:
        now = time.monotonic()
        out, running = [], []
        for call in self._running:
            if call.future.done():
                exc = call.future.exception()
                out.append(Outcome(call.key, None if exc else call.future.result(), exc))
            elif now >= call.deadline:  # given up: its thread runs on, its slot is freed
                out.append(Outcome(call.key, error=TimeoutError(f"no answer within env.step_timeout_s={self.timeout_s:g} s")))
            else:
                running.append(call)
        self._running = running
        self._start_queued()
        return out

    def shutdown(self) -> None:
        """Stop taking calls and drop the queued ones; running ones finish in the background; the
        waiting threads end."""
        self._queued.clear()
        self._running = []
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


def _run(call: _Call) -> None:
    try:
        call.future.set_result(call.run())
    except BaseException as e:  # noqa: BLE001 -- the call's error (SystemExit too) is its outcome
        call.future.set_exception(e)
