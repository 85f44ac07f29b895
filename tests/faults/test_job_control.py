"""Job control of the supervising ``tidal`` command (issue 51 item 4). Ctrl-Z (SIGTSTP) stopped only
the supervisor, while its child (in a process group of its own) trained on, 12 of 12 steps while
"paused"; SIGHUP (a closed terminal) killed the run at once with no save and its lock left behind.
Now SIGTSTP stops the child's group and then the supervisor, SIGCONT resumes both and the run
goes on; SIGHUP stops it gracefully like SIGTERM: the step saved, the lock released, exit 75."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.run.run_lock import LOCK_NAME
from tidal.run.stop import EXIT_CODE

pytestmark = pytest.mark.slow  # a tiny run apiece (20-60 s on two busy cores)

REPO = Path(__file__).resolve().parents[2]
SLOW = ["reward.components.correct.path=tests.faults.rewards:slow", "optim.lr=1e-3"]


def _start(out: Path, overrides: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={out}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, what: str, timeout: float = 300.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def _steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]  # R, S, T (stopped), ...


def _child(pid: int) -> int | None:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = f.read().split()
    return int(children[0]) if children else None


@pytest.mark.timeout(600)
def test_ctrl_z_stops_the_training_child_and_fg_resumes_it(tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    proc = _start(out, tiny_task_overrides + SLOW + ["run.steps=200", "checkpoint.every=0", "checkpoint.at_end=false"])
    try:
        child = _wait_for(lambda: _child(proc.pid), "child process", proc=proc)
        _wait_for(lambda: _steps(out) >= 1, "first step", proc=proc)
        os.kill(proc.pid, signal.SIGTSTP)
        _wait_for(lambda: _state(child) == "T" and _state(proc.pid) == "T", "stopped child and supervisor", timeout=30)
        paused_at = _steps(out)
        time.sleep(2)  # a child that trains on writes steps meanwhile (one every fraction of a second)
        assert _steps(out) == paused_at and _state(child) == "T"
        os.kill(proc.pid, signal.SIGCONT)  # what the shell's fg sends the command's process group
        _wait_for(lambda: _steps(out) > paused_at, "a step after SIGCONT", proc=proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGTERM)  # a graceful stop after the current step
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CODE and "stopped by SIGTERM" in err, err[-3000:]


@pytest.mark.timeout(600)
def test_sighup_stops_gracefully_saves_and_releases_the_lock(tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    overrides = tiny_task_overrides + SLOW + ["run.steps=200", "checkpoint.every=0", "checkpoint.at_end=true"]
    proc = _start(out, overrides)
    _wait_for(lambda: _steps(out) >= 2, "second step", proc=proc)
    os.kill(proc.pid, signal.SIGHUP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CODE, err[-3000:]
    assert "stopped by SIGHUP: checkpoint of step" in err and "rerun the same command to resume" in err, err[-3000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1 and int(saved[0].split("_")[1]) == _steps(out) < 200
    assert not (out / LOCK_NAME).exists()


@pytest.mark.timeout(600)
def test_a_process_a_reward_left_running_ends_with_the_run(tmp_path, tiny_task_overrides):
    """Issue 51 item 5: a reward's subprocess that inherits stdout kept ``tidal train ... | cat`` open
    until it ended (44.6 s after the run) and outlived the run; the command ends it and says so."""
    marker = tmp_path / "leftover.pid"
    env = dict(os.environ, OMP_NUM_THREADS="1", TIDAL_TEST_LEFTOVER=str(marker))
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={tmp_path / 'run'}", *tiny_task_overrides,
           "run.steps=1", "checkpoint.every=0", "checkpoint.at_end=false",
           "reward.components.correct.path=tests.faults.rewards:leaves_a_process"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=110)  # returns when every holder of the pipes closed them: the leftover sleeps 120 s
    assert proc.returncode == 0, err[-3000:]
    leftover = int(marker.read_text())
    assert not os.path.exists(f"/proc/{leftover}") or _state(leftover) in ("Z", "X")
    said = [line for line in err.splitlines() if line.startswith("tidal: ended")]
    assert len(said) == 1 and f"pid {leftover} (python" in said[0] and "did not stop it" in said[0], err[-3000:]
