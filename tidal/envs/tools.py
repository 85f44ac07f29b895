"""Tools and their execution with per-call time limits.

A :class:`Tool` has a name, a description and a JSON schema of its arguments (listed in the system
prompt through the chat template) and ``call(arguments, timeout_s) -> str``. A :class:`ToolSet`
runs the calls of one turn and turns every outcome into a :class:`ToolResult`:

- ``ok``: the tool's output;
- ``error``: the MODEL's call was invalid (unknown tool, missing or wrongly typed argument, a
  malformed call block): always shown to the model, counted in ``tool_errors``;
- ``failure``: the TOOL failed: it raised, exceeded ``env.tool_timeout_s``, or hit a sandbox
  limit; counted in ``tool_failures`` and handled per ``env.tool_failure`` by the environment.

Python cannot stop a thread: an in-process tool that overruns its limit is given up on (its
thread keeps running in the background until it returns, as a daemon). Tools that can overrun
(code execution) should run out of process and enforce the limit themselves, as the sandboxed
Python tool does (it kills its process group).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Literal

from tidal.envs.tool_calls import ToolCall, function_schema

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,), "array": (list,),
}


class ToolFailure(Exception):
    """Raised by a tool that could not do its job (a limit hit, a crashed backend). The message is
    shown to the model as the failure's observation (``env.tool_failure: observation``)."""


class ToolArgumentError(Exception):
    """Raised by a tool whose arguments are wrong in a way the schema cannot say (the model's
    error: shown to the model, never a failure)."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    content: str
    status: Literal["ok", "error", "failure"] = "ok"


class Tool(abc.ABC):
    """One tool. ``parameters`` is the JSON schema of the arguments object."""

    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, self.description, self.parameters)

    @abc.abstractmethod
    def call(self, arguments: dict[str, Any], *, timeout_s: float) -> str:
        """The tool's output for the model. Raise ToolArgumentError for bad arguments, ToolFailure
        when the tool itself fails; any other exception is a failure too."""

    @property
    def runs_own_timeout(self) -> bool:
        """True when ``call`` enforces ``timeout_s`` itself (e.g. by killing a subprocess), so the
        ToolSet calls it directly instead of on a watchdog thread."""
        return False


class FunctionTool(Tool):
    """A Python function as a tool: ``fn(**arguments)``; its return value is shown with ``str()``."""

    def __init__(self, fn: Callable[..., Any], *, name: str, description: str, parameters: dict[str, Any]):
        self.fn, self.name, self.description, self.parameters = fn, name, description, parameters

    def call(self, arguments: dict[str, Any], *, timeout_s: float) -> str:
        return str(self.fn(**arguments))


def check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` against an object schema (required keys, unknown keys when
    ``additionalProperties`` is false, the JSON type of each known property), or None."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if schema.get("additionalProperties") is False:
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        want = props.get(key, {}).get("type")
        types = _JSON_TYPES.get(want) if isinstance(want, str) else None
        if types and (not isinstance(value, types) or (isinstance(value, bool) and want != "boolean")):
            return f"argument '{key}' must be a JSON {want}, got {type(value).__name__}"
    return None


def _call_on_daemon(fn: Callable[[], str], timeout_s: float) -> str:
    """``fn()`` on a daemon thread, waited for ``timeout_s`` (TimeoutError past it)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(fn())
        except BaseException as e:  # delivered to the waiting caller
            fut.set_exception(e)

    threading.Thread(target=run, name="tidal-tool", daemon=True).start()
    return fut.result(timeout=timeout_s)


class ToolSet:
    """The tools of an environment and how their calls are run.

    timeout_s: per-call limit (``env.tool_timeout_s``). max_calls_per_turn: calls executed per
    turn; the others get an error result (``env.max_tool_calls_per_turn``).
    """

    def __init__(self, tools: list[Tool], *, timeout_s: float, max_calls_per_turn: int):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.max_calls_per_turn = max_calls_per_turn

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def run(self, blocks: list[ToolCall | str]) -> list[ToolResult]:
        """One result per tool-call block of a turn, in order (calls run one after another): a
        malformed block (its error message, from :func:`~tidal.envs.tool_calls.parse_turn`) is an
        error result; calls past ``max_calls_per_turn`` are not run (error results)."""
        out, n_calls = [], 0
        for block in blocks:
            if isinstance(block, str):
                out.append(ToolResult(f"error: {block}", "error"))
                continue
            n_calls += 1
            if n_calls > self.max_calls_per_turn:
                out.append(ToolResult(f"error: not run, at most {self.max_calls_per_turn} tool calls per turn", "error"))
            else:
                out.append(self.run_one(block))
        return out

    def run_one(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: unknown tool '{call.name}'; available: {sorted(self.tools)}", "error")
        problem = check_arguments(call.arguments, tool.parameters)
        if problem:
            return ToolResult(f"error: {call.name}: {problem}", "error")
        try:
            if tool.runs_own_timeout:
                return ToolResult(tool.call(call.arguments, timeout_s=self.timeout_s))
            return ToolResult(_call_on_daemon(lambda: tool.call(call.arguments, timeout_s=self.timeout_s), self.timeout_s))
        except concurrent.futures.TimeoutError:
            return ToolResult(f"error: tool '{call.name}' timed out after {self.timeout_s:g} s", "failure")
        except ToolArgumentError as e:
            return ToolResult(f"error: {call.name}: {e}", "error")
        except ToolFailure as e:
            return ToolResult(f"error: {call.name}: {e}", "failure")
        except Exception as e:
            return ToolResult(f"error: tool '{call.name}' failed: {type(e).__name__}: {e}", "failure")
