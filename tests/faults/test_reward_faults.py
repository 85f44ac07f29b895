"""Reward functions that misbehave as badly as Python allows: raise SystemExit or KeyboardInterrupt,
hang, block the event loop, end their process, return 1e39. Scoring always returns (never hangs,
never ends the trainer); the failure is that sample's error, handled by ``reward.on_error`` and
naming the component and the sample; a hang meets its time limit and is counted."""

import re
import time

import pytest
import torch

from tidal.rewards import RewardConfig, RewardEngine, RewardError, RewardSample

pytestmark = pytest.mark.timeout(60)  # today's failure mode is a hang: fail instead of waiting forever
F = "tests.faults.rewards"


def S(response: str, i: int = 0) -> RewardSample:
    return RewardSample(prompt="p", response=response, prompt_ids=[1], response_ids=[2, 3], index=i)


def engine(fn: str, *, on_error: str = "raise", deadline: float | None = None, **settings) -> RewardEngine:
    """One function component ``f`` (``settings``: its timeout_s, isolation, ...); ``deadline`` is reward.timeout_s."""
    spec = {"type": "function", "path": f"{F}:{fn}", **settings}
    cfg = RewardConfig(components={"f": spec}, recipes={"default": [["f", 1.0]]}, on_error=on_error, timeout_s=deadline)
    return RewardEngine(cfg, device=torch.device("cpu"))


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("fn, raised", [("exits", "SystemExit: 3"), ("interrupts", "KeyboardInterrupt: pressed ^C inside a reward"),
                                        ("async_exits", "SystemExit: 4")])
def test_base_exception_is_one_samples_error(fn, raised, isolation):
    with engine(fn, isolation=isolation, deadline=30) as eng:
        with pytest.raises(RewardError, match=re.escape(f"reward component 'f' failed on sample 1: function '{F}:{fn}' raised {raised}")):
            eng.score([S("a"), S("exit"), S("b")])
    with engine(fn, on_error="drop", isolation=isolation) as eng:
        out = eng.score([S("a"), S("exit"), S("b")])
        assert out.valid_B.tolist() == [True, False, True] and out.metrics["reward/f/errors_count"] == 1.0
        assert eng.score([S("c")]).total_B.tolist() == [1.0]  # the engine (and its loop) still works


def test_batched_base_exception_fails_the_batch():
    with engine("batched_exits", on_error="drop") as eng:
        out = eng.score([S("a"), S("exit")])
    assert out.valid_B.tolist() == [False, False] and out.metrics["reward/dropped_count"] == 2.0


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_hanging_function_meets_its_limit_and_is_counted(isolation):
    with engine("hangs_forever", on_error="drop", isolation=isolation, timeout_s=0.5) as eng:
        t0 = time.monotonic()
        out = eng.score([S("a"), S("hang")])
        assert time.monotonic() - t0 < 20
        assert out.valid_B.tolist() == [True, False]
        assert out.metrics["reward/f/timeouts_count"] == 1.0 and out.metrics["reward/deadline_exceeded_max"] == 0.0
        assert eng.score([S("b")]).total_B.tolist() == [1.0]
    with engine("hangs_forever", isolation=isolation, timeout_s=0.5) as eng:
        with pytest.raises(RewardError, match=rf"failed on sample 0: timed out after 0.5 s in function '{F}:hangs_forever'"):
            eng.score([S("hang")])


def _worker_pids(eng) -> set[int]:
    return eng.components["f"]._pool.live_pids()


def test_process_isolation_kills_the_hung_worker_and_replaces_it():
    with engine("hangs_forever", on_error="drop", isolation="process", timeout_s=0.5, concurrency=1) as eng:
        eng.score([S("a")])
        (before,) = _worker_pids(eng)
        assert eng.score([S("hang")]).metrics["reward/f/timeouts_count"] == 1.0
        assert eng.score([S("a")]).valid_B.tolist() == [True]  # a new worker answers
        (after,) = _worker_pids(eng)
        assert after != before
        deadline = time.monotonic() + 5
        while _running(before):
            assert time.monotonic() < deadline, "the hung worker is still running"
            time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_process_isolation_survives_a_function_that_ends_its_worker():
    with engine("kills_itself", on_error="drop", isolation="process", concurrency=1) as eng:
        out = eng.score([S("a"), S("die"), S("b")])
        assert out.valid_B.tolist() == [True, False, True]
    with engine("kills_itself", isolation="process", concurrency=1) as eng:
        with pytest.raises(RewardError, match=r"failed on sample 0: function .*:kills_itself' worker process died .*exit code -9"):
            eng.score([S("die")])


def test_a_function_that_blocks_the_event_loop_meets_the_calls_deadline():
    with engine("blocks_the_loop", on_error="drop", deadline=1.0) as eng:
        t0 = time.monotonic()
        out = eng.score([S("hang"), S("a")])
        assert time.monotonic() - t0 < 5  # the loop is blocked for 8 s: only the call's deadline can end this
        assert out.valid_B.tolist() == [False, False] and out.metrics["reward/deadline_exceeded_max"] == 1.0
        ok = eng.score([S("a")])  # on a new event loop
        assert ok.valid_B.tolist() == [True] and ok.metrics["reward/deadline_exceeded_max"] == 0.0
    with engine("blocks_the_loop", deadline=1.0) as eng:
        with pytest.raises(RewardError, match=r"failed on sample 0: no answer within the scoring call's deadline \(reward.timeout_s=1\)"):
            eng.score([S("hang")])


def test_derived_deadline_comes_from_the_components_limits():
    spec = {"f": {"type": "function", "path": f"{F}:pid", "timeout_s": 2.0, "concurrency": 4},
            "r": {"type": "remote", "url": "http://127.0.0.1:9", "batch_size": 8, "concurrency": 2, "timeout_s": 3.0,
                  "max_retries": 1, "backoff_s": 0.5, "max_backoff_s": 4.0, "retry_deadline_s": 10.0}}
    cfg = RewardConfig(components=spec, recipes={"default": [["f", 1.0], ["r", 1.0]]})
    with RewardEngine(cfg, device=torch.device("cpu")) as eng:
        assert eng.components["f"].deadline_s(10) == 3 * 2.0  # ceil(10 / 4) waves of 2 s
        # 3 batches x 2 attempts / 2 slots, + a backoff, + the waits for a busy server
        assert eng.components["r"].deadline_s(20) == 3 * 3.0 + 4.0 + 10.0
        assert eng.deadline_s({"f": 10, "r": 20}) == 23.0 + 60.0
    cfg = RewardConfig(components=spec, recipes={"default": [["f", 1.0], ["r", 1.0]]}, timeout_s=5)
    with RewardEngine(cfg, device=torch.device("cpu")) as eng:
        assert eng.deadline_s({"f": 10, "r": 20}) == 5.0


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_reward_beyond_float32_is_invalid_like_nan(isolation):
    with engine("huge", isolation=isolation) as eng:
        with pytest.raises(RewardError, match=r"failed on sample 1: function .*:huge' returned 1e\+39, beyond float32's range"):
            eng.score([S("a"), S("huge")])
    with engine("huge", on_error="drop", isolation=isolation) as eng:
        out = eng.score([S("a"), S("huge")])
    assert out.valid_B.tolist() == [True, False] and torch.isfinite(out.total_B).all()


def test_weighted_total_beyond_float32_is_invalid():
    spec = {"type": "function", "path": f"{F}:near_float32_max"}
    for on_error in ("raise", "drop"):
        cfg = RewardConfig(components={"a": spec, "b": dict(spec)}, recipes={"default": [["a", 1.0], ["b", 1.0]]}, on_error=on_error)
        with RewardEngine(cfg, device=torch.device("cpu")) as eng:
            if on_error == "raise":  # each score is a finite float32, their sum (6e38) is not
                with pytest.raises(RewardError, match=r"reward total failed on sample 0: the weighted sum of its scores, 6e\+38, is beyond float32's range"):
                    eng.score([S("a")])
            else:
                out = eng.score([S("a"), S("b")])
                assert out.valid_B.tolist() == [False, False] and out.total_B.tolist() == [0.0, 0.0]
