"""Calling a user's reward function, in this process or in a worker process of a pool.

This module imports neither torch nor the rest of the reward layer, so a worker process that runs
reward functions stays small: it imports this module, :mod:`tidal.rewards.types` (to unpickle
:class:`RewardSample`) and the user's module.

Contract of :func:`call_in_worker` (what a pool runs): it never raises and never lets an exception
escape, BaseExceptions included (``SystemExit``, ``KeyboardInterrupt``), and ``os._exit`` called by
the function raises ``SystemExit`` instead (:func:`user_call`): it returns
``("ok", float)``, ``("ok", [(float | None, error | None), ...])`` for a batched function, or
``("error", message)``. Results cross the process boundary as plain floats and strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import pickle
import threading
from typing import Any, Callable, Iterator

from tidal.config_base import ConfigError, check
from tidal.rewards.base import as_score, cut_message


def load_function(path: str, key: str) -> Callable[..., Any]:
    """Import ``module:attr.sub`` or ``module.attr``; ConfigError at ``key`` when it cannot."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    check(bool(module_name) and bool(attr), key, f"{path!r} is not 'module:function' or 'module.function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except BaseException as e:  # noqa: BLE001 -- an import that calls sys.exit() is a config error too
        raise ConfigError(key, f"cannot import module '{module_name}': {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        check(hasattr(obj, part), key, f"'{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    check(callable(obj), key, f"'{path}' is not callable")
    return obj


def is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class UserBaseException(Exception):
    """A reward function raised a BaseException that is not an Exception (``SystemExit``,
    ``KeyboardInterrupt``, ...): carried as an ordinary exception so that it is one sample's error
    and never stops the event loop or the process that called the function."""

    def __init__(self, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")


async def guarded(awaitable: Any) -> Any:
    """Await a user's coroutine; a BaseException it raises (other than our own cancellation) comes
    out as :class:`UserBaseException` (asyncio re-raises SystemExit/KeyboardInterrupt out of the loop)."""
    try:
        with user_call():
            return await awaitable
    except (asyncio.CancelledError, Exception):
        raise
    except BaseException as e:  # noqa: BLE001 -- SystemExit, KeyboardInterrupt, GeneratorExit
        raise UserBaseException(e) from None


def describe(exc: BaseException) -> str:
    """``raised <Type>: <message>`` for an exception of a user's function, bounded (:func:`cut_message`)."""
    if isinstance(exc, UserBaseException):
        return cut_message(f"raised {exc}")
    return cut_message(f"raised {type(exc).__name__}: {exc}")


_LOADED: dict[str, Callable[..., Any]] = {}
_REAL_EXIT = os._exit
_USER_CALLS = threading.local()  # depth: how many user calls this thread is inside; pid: of the process that made them


def _exit_unless_in_a_user_call(code: int) -> None:
    # a child forked inside a user call (multiprocessing's fork) ends with os._exit as it must
    if getattr(_USER_CALLS, "depth", 0) and getattr(_USER_CALLS, "pid", None) == os.getpid():
        raise SystemExit(f"os._exit({code}) called by a reward function")
    _REAL_EXIT(code)


@contextlib.contextmanager
def user_call() -> Iterator[None]:
    """Run a user's function inside: ``os._exit`` called on this thread meanwhile raises
    ``SystemExit`` (that sample's error) instead of ending the process -- with exit code 0 it ended
    the trainer as if it had finished (thread isolation), or a worker in a way the pool takes for a
    clean exit, its sample waiting out its whole limit (process isolation). Other threads (the
    watchdog's) exit as before. Installed on first use; nothing else in Tidal replaces ``os._exit``."""
    os._exit = _exit_unless_in_a_user_call
    _USER_CALLS.pid = os.getpid()
    _USER_CALLS.depth = getattr(_USER_CALLS, "depth", 0) + 1
    try:
        yield
    finally:
        _USER_CALLS.depth -= 1


def _run(fn: Callable[..., Any], arg: Any) -> Any:
    out = fn(arg)
    if inspect.isawaitable(out):
        out = asyncio.run(guarded(out))
    return out


def call_in_worker(path: str, payload: bytes, batched: bool) -> tuple[str, Any]:
    """Run the function at ``path`` on the argument pickled in ``payload`` (pickled by the caller,
    so that an argument that cannot be pickled is the caller's error, not the pool's; see the
    module docstring for the result)."""
    try:
        arg = pickle.loads(payload)
        fn = _LOADED.get(path)
        if fn is None:
            fn = _LOADED[path] = load_function(path, "function")
        with user_call():
            value = _run(fn, arg)
    except BaseException as e:  # noqa: BLE001 -- the worker survives whatever the function does
        return "error", describe(e)
    return checked_value(value, arg, batched)


def checked_value(value: Any, arg: Any, batched: bool) -> tuple[str, Any]:
    """What a reward function returned, checked where the call ran: ``("ok", score)`` for a single
    call; ``("ok", [(score, None) | (None, why), ...])`` for a batched one (one entry per sample of
    ``arg``); ``("error", why)`` when the value is not a score, or a batch of the wrong length."""
    if not batched:
        try:
            return "ok", as_score(value)
        except (TypeError, ValueError) as e:
            return "error", str(e)
    if not isinstance(value, (list, tuple)) or len(value) != len(arg):
        got = f"{len(value)} values" if isinstance(value, (list, tuple)) else type(value).__name__
        return "error", f"returned {got} for {len(arg)} samples"
    out = []
    for v in value:
        try:
            out.append((as_score(v), None))
        except (TypeError, ValueError) as e:
            out.append((None, str(e)))
    return "ok", out
