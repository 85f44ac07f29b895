"""Custom reward functions named by ``module:function``.

Contract of a reward function: ``fn(sample: RewardSample) -> number`` (``def`` or ``async def``);
with ``fn.batched = True``: ``fn(samples: list[RewardSample]) -> list[number]`` of the same length.

Every call has a time limit. An ``async def`` function is cancelled at its limit (at its next
``await``). A ``def`` function runs on its own daemon thread; at its limit the sample is given up on
and training goes on, but Python cannot stop a thread, so the call keeps running in the background
until it returns (counted in ``reward/<name>/timeouts``; write long-running functions as ``async``
or give them their own internal limit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import math
import threading
from typing import Any, Callable

from tidal.config_base import ConfigError, check
from tidal.rewards.base import AsyncComponent, ComponentResult, as_score
from tidal.rewards.config import FunctionRewardConfig
from tidal.rewards.types import RewardSample


def load_function(path: str, key: str) -> Callable[..., Any]:
    """Import ``module:attr.sub`` or ``module.attr``; ConfigError at ``key`` when it cannot."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    check(bool(module_name) and bool(attr), key, f"{path!r} is not 'module:function' or 'module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(key, f"cannot import module '{module_name}': {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        check(hasattr(obj, part), key, f"'{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    check(callable(obj), key, f"'{path}' is not callable")
    return obj


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _start_daemon_call(fn: Callable[[Any], Any], arg: Any) -> concurrent.futures.Future:
    """Run ``fn(arg)`` on a new daemon thread (a hung call never blocks interpreter exit)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(arg))
        except BaseException as e:  # delivered to the waiting coroutine
            fut.set_exception(e)

    threading.Thread(target=run, name="tidal-reward-fn", daemon=True).start()
    return fut


class FunctionReward(AsyncComponent):
    """A Python reward function as a component."""

    counter_names = ("timeouts",)

    def __init__(self, cfg: FunctionRewardConfig, *, key: str):
        self.cfg = cfg
        self.fn = load_function(cfg.path, f"{key}.path")
        self.is_async = _is_async(self.fn)
        self.batched = getattr(self.fn, "batched", False) is True
        self.label = cfg.path

    async def _call(self, arg: Any) -> Any:
        if self.is_async:
            return await asyncio.wait_for(self.fn(arg), self.cfg.timeout_s)
        return await asyncio.wait_for(asyncio.wrap_future(_start_daemon_call(self.fn, arg)), self.cfg.timeout_s)

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
                value = await self._call(sample)
            except asyncio.TimeoutError:
                return math.nan, f"timed out after {self.cfg.timeout_s:g} s in function '{self.label}'", True
            except Exception as e:
                return math.nan, f"function '{self.label}' raised {type(e).__name__}: {e}", False
        try:
            return as_score(value), None, False
        except (TypeError, ValueError) as e:
            return math.nan, f"function '{self.label}' {e}", False

    async def _score_batched(self, samples: list[RewardSample]) -> ComponentResult:
        n = len(samples)
        try:
            values = await self._call(list(samples))
        except asyncio.TimeoutError:
            msg = f"timed out after {self.cfg.timeout_s:g} s in batched function '{self.label}' ({n} samples)"
            return ComponentResult.failed(n, msg, timeouts=1.0)
        except Exception as e:
            return ComponentResult.failed(n, f"batched function '{self.label}' raised {type(e).__name__}: {e}")
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            return ComponentResult.failed(n, f"batched function '{self.label}' returned {got} for {n} samples")
        result = ComponentResult(scores=[], counters={"timeouts": 0.0})
        for i, v in enumerate(values):
            try:
                result.scores.append(as_score(v))
            except (TypeError, ValueError) as e:
                result.scores.append(math.nan)
                result.errors[i] = f"batched function '{self.label}' {e}"
        return result
