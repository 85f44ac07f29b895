"""The run-directory lock (tidal/run/run_lock.py; wired into setup by the lead): a second run in
the same output_dir gets a ConfigError naming the first (pid, host, command); a lock whose process
is gone (same host) is taken over; another host's lock is never taken over; starting at once, only
one run gets it; release removes only its own lock."""

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.config_base import ConfigError
from tidal.run.run_lock import LOCK_NAME, acquire_run_lock

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys, time; from tidal.run.run_lock import acquire_run_lock; acquire_run_lock(sys.argv[1], 0); print('held', flush=True); time.sleep(60)"


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_gets_an_error_naming_the_first(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(ConfigError) as info:
            acquire_run_lock(tmp_path, 0)
        assert info.value.key == "run.output_dir"
        assert f"is in use by another run: pid {proc.pid} on host {socket.gethostname()!r}" in info.value.message
        assert "-c" in info.value.message  # the other run's command line
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_runs_lock_is_taken_over(tmp_path, capsys):
    proc = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with acquire_run_lock(tmp_path, 0) as lock:
        assert lock.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the stale run lock of pid {proc.pid}" in capsys.readouterr().err
    assert not (tmp_path / LOCK_NAME).exists()  # released


def test_a_reused_pid_is_not_the_owner(tmp_path):
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": 1, "started": "then", "argv": [], "token": "x"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(owner))  # our pid, but a process that started at tick 1
    assert acquire_run_lock(tmp_path, 0).held


def test_the_same_process_takes_its_own_lock_over(tmp_path, capsys):
    """A process runs one run at a time: an earlier run it built and never released (a notebook,
    a test) does not lock it out; the old lock's release then leaves the new one alone."""
    first = acquire_run_lock(tmp_path, 0)
    second = acquire_run_lock(tmp_path, 0)
    assert f"pid {os.getpid()}" in capsys.readouterr().err  # the take-over is said
    first.release()
    assert (tmp_path / LOCK_NAME).exists()
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_another_hosts_lock_is_never_taken_over(tmp_path):
    owner = {"pid": 1, "host": "gpu-node-7", "start_ticks": 5, "started": "yesterday", "argv": ["tidal", "train"], "token": "y"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(owner))
    with pytest.raises(ConfigError) as info:
        acquire_run_lock(tmp_path, 0)
    assert "pid 1 on host 'gpu-node-7' since yesterday (tidal train)" in info.value.message
    assert f"if that run is dead, delete {tmp_path / LOCK_NAME}" in info.value.message


def test_unreadable_lock_is_an_error_naming_the_file(tmp_path):
    (tmp_path / LOCK_NAME).write_text("garbage")
    with pytest.raises(ConfigError, match=f"{tmp_path / LOCK_NAME} is unreadable .* delete that file"):
        acquire_run_lock(tmp_path, 0)


def test_other_ranks_hold_nothing_and_release_only_their_own(tmp_path):
    assert not acquire_run_lock(tmp_path, 1).held and not (tmp_path / LOCK_NAME).exists()
    lock = acquire_run_lock(tmp_path, 0)
    (tmp_path / LOCK_NAME).unlink()
    other = acquire_run_lock(tmp_path, 0)  # someone took the directory after our lock vanished
    lock.release()  # must not remove the other's lock
    assert (tmp_path / LOCK_NAME).exists()
    other.release()
    assert not (tmp_path / LOCK_NAME).exists()


def _race(run_dir: str, start: float, out) -> None:
    while time.time() < start:
        pass
    try:
        lock = acquire_run_lock(run_dir, 0)
        out.put("won")
        time.sleep(1.0)
        lock.release()
    except ConfigError:
        out.put("refused")


def test_runs_starting_at_once_get_it_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start = time.time() + 0.5
    procs = [ctx.Process(target=_race, args=(str(tmp_path), start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    assert results == ["refused", "refused", "refused", "won"], results


def test_tidal_train_in_a_directory_another_run_holds_exits_2_naming_it(tmp_path, tiny_task_overrides):
    """End to end: a second `tidal train` into a run directory whose lock a live process holds stops
    before anything loads, naming that process; once it is gone the lock is taken over."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from tidal.run.run_lock import acquire_run_lock; "
        f"acquire_run_lock({str(tmp_path)!r}, 0); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.run([sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={tmp_path}",
                               *tiny_task_overrides], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"is in use by another run: pid {holder.pid}" in proc.stderr and "Loading weights" not in proc.stderr
    finally:
        holder.kill()
        holder.wait()


def test_an_earlier_attempt_of_the_same_torchrun_job_is_taken_over_on_any_host(tmp_path, monkeypatch, capsys):
    """Issue 48 item 3: after an elastic restart on the nodes left, rank 0 may be on another host
    than the lock's; a lock of an earlier attempt of the same torchrun job (TORCHELASTIC_RUN_ID,
    a lower TORCHELASTIC_RESTART_COUNT) is taken over; another job's, or this attempt's, is not."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "grpo-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    owner = {"pid": 1, "host": "gpu-node-7", "start_ticks": 5, "started": "yesterday", "argv": ["tidal", "train"],
             "token": "y", "elastic": {"run_id": "grpo-1", "restart": 0}}
    (tmp_path / LOCK_NAME).write_text(json.dumps(owner))
    lock = acquire_run_lock(tmp_path, 0)
    assert lock.held and json.loads((tmp_path / LOCK_NAME).read_text())["elastic"] == {"run_id": "grpo-1", "restart": 1}
    assert "taking over the stale run lock of pid 1 on host 'gpu-node-7'" in capsys.readouterr().err
    lock.release()
    for elastic in ({"run_id": "grpo-1", "restart": 1}, {"run_id": "grpo-2", "restart": 0}, None):
        (tmp_path / LOCK_NAME).write_text(json.dumps({**owner, "elastic": elastic}))
        with pytest.raises(ConfigError, match="is in use by another run: pid 1 on host 'gpu-node-7'"):
            acquire_run_lock(tmp_path, 0)
