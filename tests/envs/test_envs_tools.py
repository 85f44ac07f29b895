"""Tools: the calculator, argument checks, per-call time limits, failures vs the model's errors,
and the worker pool's deadlines."""

import threading
import time

import pytest

from tidal.envs.calculator import calculate
from tidal.envs.executor import StepPool
from tidal.envs.tool_calls import ToolCall
from tidal.envs.tools import FunctionTool, ToolArgumentError, ToolFailure, ToolSet

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


@pytest.mark.parametrize("expr, want", [
    ("347*29", "10063"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("6/3", "2"), ("-5--2", "-3"),
    ("2**10", "1024"), ("17//5", "3"), ("17%5", "2"), (" 12 + 1 ", "13"), ("1.5*2", "3"),
])
def test_calculator(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize("expr, message", [
    ("1/0", "division by zero"), ("2**1000", "exponent"), ("__import__('os')", "unsupported element"),
    ("1+", "cannot parse"), ("x*2", "unsupported element"), ("9" * 99 + "*" + "9" * 99, "too large"), ("1" * 300, "longer"),
])
def test_calculator_rejects(expr, message):
    with pytest.raises(ToolArgumentError, match=message):
        calculate(expr)


def _toolset(fn, timeout_s=0.5, max_calls=2):
    return ToolSet([FunctionTool(fn, name="f", description="d", parameters=SCHEMA)], timeout_s=timeout_s, max_calls_per_turn=max_calls)


def test_results_errors_and_failures():
    def f(x):
        if x == 1:
            raise ToolArgumentError("x must not be 1")
        if x == 2:
            raise ToolFailure("backend down")
        if x == 3:
            raise RuntimeError("bug")
        return x * 10

    ts = _toolset(f, max_calls=9)
    res = ts.run([ToolCall("f", {"x": 0}), ToolCall("g", {}), ToolCall("f", {}), ToolCall("f", {"x": "a"}),
                  ToolCall("f", {"x": 0, "y": 1}), ToolCall("f", {"x": 1}), ToolCall("f", {"x": 2}), ToolCall("f", {"x": 3}),
                  "tool call 9 is not valid JSON"])
    assert [r.status for r in res] == ["ok", "error", "error", "error", "error", "error", "failure", "failure", "error"]
    assert res[0].content == "0"
    assert "unknown tool 'g'" in res[1].content and "missing required" in res[2].content
    assert "must be a JSON integer" in res[3].content and "unknown argument" in res[4].content
    assert "x must not be 1" in res[5].content and "backend down" in res[6].content and "RuntimeError: bug" in res[7].content
    assert res[8].content == "error: tool call 9 is not valid JSON"


def test_a_hanging_tool_meets_its_timeout():
    release = threading.Event()
    ts = _toolset(lambda x: release.wait(30), timeout_s=0.3)
    t0 = time.monotonic()
    (res,) = ts.run([ToolCall("f", {"x": 0})])
    release.set()
    assert res.status == "failure" and "timed out after 0.3 s" in res.content
    assert time.monotonic() - t0 < 5


def test_calls_beyond_the_per_turn_limit_are_not_run():
    seen = []
    ts = _toolset(lambda x: seen.append(x) or x, max_calls=2)
    res = ts.run([ToolCall("f", {"x": i}) for i in range(3)])
    assert seen == [0, 1] and res[2].status == "error" and "at most 2 tool calls" in res[2].content


def test_step_pool_returns_finished_calls_and_times_out_hung_ones():
    pool = StepPool(workers=2, timeout_s=0.3)
    release = threading.Event()
    pool.submit("slow", release.wait, 30)
    pool.submit("fast", lambda: 42)
    got = {}
    while len(pool):
        for out in pool.collect(block=True):
            got[out.key] = out
    release.set()
    pool.shutdown()
    assert got["fast"].value == 42 and got["fast"].error is None
    assert isinstance(got["slow"].error, TimeoutError) and "step_timeout_s=0.3" in str(got["slow"].error)


def test_a_calls_time_limit_starts_when_it_runs_not_when_it_is_queued():
    """Three hung calls take every slot of a 3-worker pool; the healthy calls queued behind them
    (each 0.1 s) run once the hung ones are given up at their limit and finish with their values
    (their limit counted from submission would have expired in the queue)."""
    pool = StepPool(workers=3, timeout_s=0.4)
    release = threading.Event()
    for k in range(3):
        pool.submit(("hung", k), release.wait, 30)
    for k in range(3):
        pool.submit(("ok", k), lambda k=k: time.sleep(0.1) or k)
    got = {}
    while len(pool):
        for out in pool.collect(block=True):
            got[out.key] = out
    release.set()
    pool.shutdown()
    assert all(isinstance(got[("hung", k)].error, TimeoutError) for k in range(3))
    assert [(got[("ok", k)].value, got[("ok", k)].error) for k in range(3)] == [(0, None), (1, None), (2, None)]


def test_step_pool_runs_at_most_workers_calls_at_once():
    active, peak, lock = [0], [0], threading.Lock()

    def call():
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1

    pool = StepPool(workers=2, timeout_s=5)
    for k in range(6):
        pool.submit(k, call)
    done = []
    while len(pool):
        done += [out.key for out in pool.collect(block=True)]
    assert sorted(done) == list(range(6)) and peak[0] == 2


def test_step_pool_reuses_its_threads():
    """Calls in sequence run on one thread (no thread started per call, ``Thread.start`` waits for
    the OS to run it); after ``shutdown`` the waiting thread ends."""
    pool = StepPool(workers=4, timeout_s=5)
    names = []
    for k in range(5):
        pool.submit(k, lambda: threading.get_ident())
        while len(pool):
            names += [out.value for out in pool.collect(block=True)]
    assert len(names) == 5 and len(set(names)) == 1
    before = threading.active_count()
    pool.shutdown()
    deadline = time.monotonic() + 5
    while threading.active_count() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before - 1
