"""Unit tests: the TIDAL_FAULT grammar, and the watchdog's divergence rule on hand-written heartbeats."""

import json

import pytest

from tidal.run import faults
from tidal.run.watchdog import Watchdog, format_report


def test_fault_rules_parse_and_match(monkeypatch):
    (kill, nan, rec) = faults.parse("kill@stage/train:rank=1:step=3; nan@policy_logp:step=4- ;record@sampled:attempt=any:dir=/x")
    assert (kill.action, kill.point, kill.rank, kill.first_step, kill.last_step, kill.attempt) == ("kill", "stage/train", 1, 3, 3, 0)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert kill.matches("stage/train", 3, 1)
    assert not kill.matches("stage/train", 3, 0) and not kill.matches("stage/train", 4, 1) and not kill.matches("stage/reward", 3, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted by torchrun: not killed again
    assert not kill.matches("stage/train", 3, 1)
    assert rec.matches("sampled", 7, 0) and rec.dir == "/x"  # attempt=any
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert nan.matches("policy_logp", 9, 0) and not nan.matches("policy_logp", 3, 0) and not nan.matches("policy_logp", None, 0)
    assert faults.parse("") == [] and faults.parse(" ; ") == []


@pytest.mark.parametrize("spec", ["kill", "explode@stage/train", "kill@", "kill@x:rank=a", "kill@x:when=1", "record@sampled"])
def test_malformed_fault_rule_is_an_error(spec):
    with pytest.raises(ValueError, match="TIDAL_FAULT"):
        faults.parse(spec)


def test_hooks_are_no_ops_when_unset():
    assert faults._RULES == [] and not faults.enabled()  # the test process runs without TIDAL_FAULT
    x = object()
    assert faults.corrupt("policy_logp", x) is x
    faults.hit("stage/train", step=1, rank=0)


def _watchdog(tmp_path, rank=0, world=2, timeout=10.0) -> Watchdog:
    wd = Watchdog(rank=rank, world_size=world, run_dir=tmp_path, timeout_s=timeout)
    wd.session = "s1"
    wd.dir.mkdir(parents=True)
    return wd


def _beat(wd: Watchdog, rank: int, *, step: int, k: int, stage: str, entered: float, session="s1", state="in"):
    beat = {"rank": rank, "session": session, "pid": 1, "step": step, "k": k, "stage": stage, "state": state, "entered": entered}
    (wd.dir / f"rank{rank}.json").write_text(json.dumps(beat))


def _at(wd: Watchdog, *, step: int, k: int, stage: str, entered: float, state="in"):
    wd.step, wd._k = step, k
    wd._state = {**wd._make_state(stage, state), "session": wd.session, "entered": entered}


def test_in_step_ranks_never_diverge(tmp_path):
    wd = _watchdog(tmp_path)
    _at(wd, step=3, k=5, stage="generate", entered=0.0)
    _beat(wd, 1, step=3, k=5, stage="generate", entered=0.0)
    assert wd.check(now=1e6) is None  # a long stage on every rank is not a divergence


def test_rank_behind_past_the_deadline_is_reported(tmp_path):
    wd = _watchdog(tmp_path, timeout=10.0)  # poll 0.5 s: reports after 8.5 s of waiting
    _at(wd, step=2, k=9, stage="advantages", entered=100.0, state="done")
    _beat(wd, 1, step=2, k=7, stage="reward", entered=99.0)
    assert wd.check(now=108.0) is None
    report = wd.check(now=109.0)
    assert report["behind"] == [1]
    assert [(r["rank"], r["stage"], r["behind"]) for r in report["ranks"]] == [(0, "advantages", False), (1, "reward", True)]
    text = format_report(report, "ranks diverged")
    assert "rank 0: step 2, after stage 'advantages' for 9.0 s" in text
    assert "rank 1: step 2, in stage 'reward' for 10.0 s  <- behind" in text and "diverged (behind): ranks [1]" in text


def test_an_earlier_step_is_behind(tmp_path):
    wd = _watchdog(tmp_path, rank=0, world=3, timeout=10.0)
    _at(wd, step=4, k=1, stage="step start", entered=0.0)
    _beat(wd, 1, step=4, k=1, stage="step start", entered=0.0)
    _beat(wd, 2, step=3, k=20, stage="checkpoint", entered=0.0)
    assert wd.check(now=50.0)["behind"] == [2]


def test_stale_session_and_missing_heartbeats(tmp_path):
    wd = _watchdog(tmp_path, timeout=10.0)
    wd._started = 0.0
    _at(wd, step=1, k=1, stage="generate", entered=0.0)
    _beat(wd, 1, step=9, k=3, stage="train", entered=0.0, session="old-run")  # another launch's file: ignored
    assert wd.check(now=5.0) is None  # rank 1 may still be starting
    report = wd.check(now=20.0)
    assert report["behind"] == [1] and "wrote no heartbeat" in report["why"]
    _beat(wd, 1, step=1, k=1, stage="generate", entered=0.0, state="closed")
    assert wd.check(now=1e6) is None  # a rank finished: the run is ending


def test_exception_in_a_stage_gets_a_note_naming_every_rank(tmp_path):
    wd = _watchdog(tmp_path, timeout=10.0)
    _beat(wd, 1, step=2, k=3, stage="reward", entered=0.0)
    wd.set_step(2)
    with pytest.raises(RuntimeError) as info:
        with wd.stage("train"):
            raise RuntimeError("gloo timed out")
    note = "\n".join(info.value.__notes__)
    assert "rank 0 failed in step 2, stage 'train'" in note
    assert "rank 1: step 2, in stage 'reward'" in note and "<- behind" in note
