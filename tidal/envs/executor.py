"""The pool that runs environment calls (``reset``/``step``, and so their tools) off the rollout loop.

The rollout loop submits a call and goes back to decoding; :meth:`StepPool.collect` hands back
the calls that finished and those that ran past ``env.step_timeout_s`` (a TimeoutError outcome).
A call past its limit is given up on, but Python cannot stop its thread: it keeps a worker until
it returns (tools bound their own calls, so this needs a broken environment).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Hashable


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A finished call: ``value`` when ``error`` is None, else the exception it raised (a
    TimeoutError when it ran past its limit)."""

    key: Hashable
    value: Any = None
    error: BaseException | None = None


class StepPool:
    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidal-env")
        self._pending: dict[concurrent.futures.Future, tuple[Hashable, float]] = {}

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        self._pending[self._pool.submit(fn, *args)] = (key, time.monotonic() + self.timeout_s)

    def __len__(self) -> int:
        return len(self._pending)

    def collect(self, *, block: bool, timeout: float | None = None) -> list[Outcome]:
        """Outcomes of the finished calls and of those past their deadline. ``block``: wait until
        there is at least one (when any call is pending), or at most ``timeout`` seconds when given."""
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self._harvest()
            if out or not block or not self._pending:
                return out
            wake = min(d for _, d in self._pending.values())
            if give_up is not None:
                if time.monotonic() >= give_up:
                    return out
                wake = min(wake, give_up)
            concurrent.futures.wait(list(self._pending), timeout=max(0.0, wake - time.monotonic()),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _harvest(self) -> list[Outcome]:
        now = time.monotonic()
        out = []
        for fut, (key, deadline) in list(self._pending.items()):
            if fut.done():
                del self._pending[fut]
                exc = fut.exception()
                out.append(Outcome(key, None if exc else fut.result(), exc))
            elif now >= deadline:
                del self._pending[fut]
                fut.cancel()
                out.append(Outcome(key, error=TimeoutError(f"no answer within env.step_timeout_s={self.timeout_s:g} s")))
        return out

    def shutdown(self) -> None:
        """Stop taking calls; running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
