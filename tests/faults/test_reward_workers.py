"""Reward workers (issue 35 item 8):

- a `def` reward that hangs under thread isolation used to leave one thread per timed-out call
  (the trainer was killed for memory, exit 137, after 4 steps): overdue threads are bounded at the
  function's `concurrency`; past that, new calls are not started and each sample says why;
- `os._exit(0)` in a reward ended the trainer with exit code 0 (thread isolation), or under process
  isolation made its sample wait out its whole limit (the pool takes a worker that exits with code 0
  for a clean exit): it is that sample's error at once, and the process goes on.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tidal.rewards import RewardConfig, RewardEngine, RewardSample

pytestmark = pytest.mark.timeout(120)
F = "tests.faults.rewards"
REPO = Path(__file__).resolve().parents[2]


def S(response: str, i: int = 0) -> RewardSample:
    return RewardSample(prompt="p", response=response, prompt_ids=[1], response_ids=[2, 3], index=i)


def engine(fn: str, *, on_error: str = "drop", **settings) -> RewardEngine:
    cfg = RewardConfig(components={"f": {"type": "function", "path": f"{F}:{fn}", **settings}},
                       recipes={"default": [["f", 1.0]]}, on_error=on_error)
    return RewardEngine(cfg, device=torch.device("cpu"))


def _reward_threads() -> int:
    return sum(t.name == "tidal-reward-fn" and t.is_alive() for t in threading.enumerate())


def test_hung_thread_calls_are_bounded():
    with engine("hangs_a_while", timeout_s=0.2, concurrency=2) as eng:
        before = _reward_threads()
        for _step in range(4):  # four steps of 4 samples that all hang: 16 threads before
            out = eng.score([S("hang", i) for i in range(4)])
            assert out.valid_B.tolist() == [False] * 4
            assert _reward_threads() - before <= 2
        assert out.metrics["reward/f/timeouts_count"] == 0.0  # none of the last step's calls started
        refused = eng.score([S("a")])
        assert refused.valid_B.tolist() == [False]
        deadline = time.monotonic() + 10
        while _reward_threads() > before:  # the overdue calls return by themselves
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert eng.score([S("a"), S("b")]).total_B.tolist() == [1.0, 1.0]  # then calls start again


def test_a_refused_call_names_the_reason():
    from tidal.rewards import RewardError

    with engine("hangs_a_while", on_error="raise", timeout_s=0.2, concurrency=1) as eng:
        with pytest.raises(RewardError, match="timed out after 0.2 s"):
            eng.score([S("hang")])
        with pytest.raises(RewardError, match=r"not started: 1 earlier calls are still running past timeout_s=0.2 .* "
                                              r"set isolation: process"):
            eng.score([S("a")])


SCRIPT = f"""
import torch
from tidal.rewards import RewardConfig, RewardEngine, RewardSample
cfg = RewardConfig(components={{"f": {{"type": "function", "path": "{F}:exits_cleanly"}}}},
                   recipes={{"default": [["f", 1.0]]}}, on_error="drop")
with RewardEngine(cfg, device=torch.device("cpu")) as eng:
    out = eng.score([RewardSample(prompt="p", response=r, prompt_ids=[1], response_ids=[2], index=i)
                     for i, r in enumerate(["a", "bye"])])
    print("valid", out.valid_B.tolist(), flush=True)
print("ALIVE", flush=True)
"""


def test_os_exit_0_in_a_thread_reward_does_not_end_the_trainer():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "valid [True, False]" in proc.stdout and "ALIVE" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_child_forked_by_a_reward_still_exits_normally():
    with engine("forks_a_child", on_error="raise") as eng:  # thread isolation: the child's os._exit is the real one
        assert eng.score([S("a")]).total_B.tolist() == [1.0]


def test_os_exit_0_in_a_worker_is_that_samples_error_at_once():
    from tidal.rewards import RewardError

    with engine("exits_cleanly", on_error="raise", isolation="process", timeout_s=30, concurrency=1) as eng:
        assert eng.score([S("a")]).total_B.tolist() == [1.0]  # the worker is up
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"raised SystemExit: os._exit\(0\) called by a reward function"):
            eng.score([S("bye")])
        assert time.monotonic() - t0 < 10  # not its whole limit of 30 s
        assert eng.score([S("a")]).total_B.tolist() == [1.0]


@pytest.mark.parametrize("fn", ["posix_exits", "bound_exits", "ctypes_exits"])
def test_a_worker_that_ends_with_code_0_is_that_samples_error_at_once(fn):
    """Issue 44 item 3: ``posix._exit(0)``, an ``_exit`` bound at import and ctypes' ``_exit(0)``
    bypass the ``os._exit`` guard; the pool noticed no death (exit code 0 looks clean to pebble) and
    the sample waited out its whole limit. Any worker that ends mid-call is its call's error at once."""
    from tidal.rewards import RewardError

    with engine(fn, on_error="raise", isolation="process", timeout_s=30, concurrency=1) as eng:
        assert eng.score([S("a")]).total_B.tolist() == [1.0]  # the worker is up
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"worker process died \(Abnormal termination .*exit code 0\)"):
            eng.score([S("bye")])
        assert time.monotonic() - t0 < 10  # not its whole limit of 30 s
        assert eng.score([S("a"), S("b")]).total_B.tolist() == [1.0, 1.0]  # a new worker answers


def _deep(levels: int) -> dict:
    out: dict = {}
    for _ in range(levels):
        out = {"a": out}
    return out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # pebble's thread dies, as it did
def test_a_sample_too_deep_to_pickle_is_its_error_and_a_broken_pool_is_replaced(capsys):
    """Issue 44 item 1: metadata nested 600 levels deep made pebble's scheduler thread die of a
    RecursionError while pickling the task: the call never returned and every later call failed
    ("Unexpected error within the Pool"). The argument is pickled before it is scheduled (that
    sample's error), and a pool that broke anyway is replaced."""
    from tidal.rewards.worker import call_in_worker

    with engine("text_hash_reward", isolation="process", timeout_s=30, concurrency=1) as eng:
        deep = RewardSample(prompt="p", response="a", prompt_ids=[1], response_ids=[2], metadata=_deep(600))
        t0 = time.monotonic()
        out = eng.score([deep, S("a", 1)])
        assert out.valid_B.tolist() == [False, True] and time.monotonic() - t0 < 20
        pool = eng.components["f"]._pool
        broken = pool._pool
        lost = broken.schedule(call_in_worker, args=("x", deep, False))  # break pebble's own pool as the deep sample did
        with pytest.raises(TimeoutError):
            lost.result(timeout=1)  # never answered: its scheduler thread died pickling it
        assert eng.score([S("b")]).valid_B.tolist() == [True] and pool._pool is not broken
        assert "is broken (Unexpected error within the Pool); starting a new one" in capsys.readouterr().err
