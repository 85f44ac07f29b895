"""One asyncio event loop on a daemon thread, for async client libraries (MCP, OpenEnv clients)
called from the rollout's worker threads.

``BackgroundLoop.run(coro, timeout_s)`` runs a coroutine on the loop and waits for it from the
calling thread; past ``timeout_s`` it cancels the coroutine and raises ``TimeoutError``. A
long-lived async context manager (a server's connection) is held open by :meth:`BackgroundLoop.hold`
in a task of its own (anyio's task groups must be entered and exited by the same task) until
:meth:`BackgroundLoop.release` exits it or :meth:`BackgroundLoop.close` exits them all and stops
the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable


class BackgroundLoop:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self._holders: list[tuple[asyncio.Event, asyncio.Task]] = []
        self._values: list[tuple[asyncio.Event, asyncio.Task, Any]] = []  # each held context and what it gave

    def run(self, coro: Awaitable[Any], timeout_s: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout_s:g} s") from None

    def hold(self, context: Any, timeout_s: float | None = None) -> Any:
        """Enter the async context manager ``context`` in a task of its own and return what it
        gives; it stays open until :meth:`close`."""

        async def start():
            stop, ready = asyncio.Event(), self.loop.create_future()
            task = self.loop.create_task(_hold(context, ready, stop))
            self._holders.append((stop, task))
            value = await ready
            self._values.append((stop, task, value))
            return value

        return self.run(start(), timeout_s)

    def release(self, value: Any, timeout_s: float = 5.0) -> None:
        """Exit the held context that gave ``value`` (waiting at most ``timeout_s``: a dead
        server's context may not exit cleanly); unknown values are ignored."""
        held = [(stop, task) for stop, task, v in self._values if v is value]
        if not held:
            return
        self._values = [item for item in self._values if item[2] is not value]
        self._holders = [h for h in self._holders if h != held[0]]

        async def stop_one():
            held[0][0].set()
            await asyncio.wait([held[0][1]], timeout=timeout_s)

        try:
            self.run(stop_one(), timeout_s + 1)
        except Exception:  # noqa: BLE001 -- a broken context that fails to exit is gone all the same
            pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Exit every held context (newest first) and stop the loop."""

        async def stop_all():
            for stop, task in reversed(self._holders):
                stop.set()
                await asyncio.wait([task], timeout=timeout_s)

        try:
            self.run(stop_all(), timeout_s * (len(self._holders) + 1))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)


async def _hold(context: Any, ready: asyncio.Future, stop: asyncio.Event) -> None:
    try:
        async with context as value:
            ready.set_result(value)
            await stop.wait()
    except BaseException as e:  # a failure to enter goes to the caller of hold()
        if not ready.done():
            ready.set_exception(e)
