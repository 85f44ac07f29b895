"""SIGINT / SIGTERM stop a run gracefully: every rank finishes the step in which the first signal
arrived, a checkpoint of that step is saved, the process exits with tidal.run.stop.EXIT_CODE (75),
and the same command resumes exactly; a second signal aborts at once. Signals are delivered by
TIDAL_FAULT (sigterm/sigint at a stage of a step, on one rank)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.test_torchrun_faults import COMMON, assert_same_metrics, metrics, torchrun
from tidal.run.stop import EXIT_CODE

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def tidal_train(out: Path, overrides: list[str], fault: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TIDAL_FAULT=fault)
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={out}", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_sigint_saves_the_step_and_the_rerun_resumes_exactly(tmp_path, tiny_task_overrides):
    overrides = tiny_task_overrides + COMMON + ["checkpoint.every=0"]  # only the stop and the end save
    ref = tidal_train(tmp_path / "ref", overrides)
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    stopped = tidal_train(out, overrides, fault="sigint@stage/reward:step=3")
    assert stopped.returncode == EXIT_CODE, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    assert "stopped by SIGINT: checkpoint of step 3 saved; rerun the same command to resume" in stopped.stderr
    assert sorted(metrics(out)) == [1, 2, 3]
    assert (out / "checkpoints" / "step_000003" / "trainer.json").is_file()
    resumed = tidal_train(out, overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_000003'} (step 3)" in resumed.stdout
    assert_same_metrics(metrics(out), metrics(tmp_path / "ref"))


def test_a_second_signal_aborts_at_once(tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    proc = tidal_train(out, tiny_task_overrides + COMMON, fault="sigterm@stage/reward:step=3;sigterm@stage/train:step=3")
    assert proc.returncode == -15, proc.stderr[-3000:]  # killed by the second SIGTERM, inside step 3
    assert sorted(metrics(out)) == [1, 2]
    assert not (out / "checkpoints" / "step_000003").exists()


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, tiny_task_overrides):
    """torchrun, 2 ranks: only rank 1 is signalled; both finish step 3, save it and exit 75."""
    out = tmp_path / "run"
    proc, _ = torchrun(out, tiny_task_overrides + COMMON, fault="sigterm@stage/train:rank=1:step=3")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {EXIT_CODE}" in text, text[-4000:]
    assert "stopped by SIGTERM: checkpoint of step 3 saved" in text
    assert sorted(metrics(out)) == [1, 2, 3]
    trainer_json = json.loads((out / "checkpoints" / "step_000003" / "trainer.json").read_text())
    assert trainer_json["step"] == 3
    resumed, _ = torchrun(out, tiny_task_overrides + COMMON)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert sorted(metrics(out)) == [1, 2, 3, 4]


def test_ctrl_c_in_the_task_build_says_one_line_exits_75_and_keeps_the_finished_phase(tmp_path):
    """Ctrl-C in the warm start's phase 2 (issue 44 item 12): one line, no traceback, the stop's exit
    code; phase 1 is kept for the rerun (which continues from it: tests/unit/test_task_build.py)."""
    task = ["task.name=arithmetic", "task.digits=1", "task.num_train=20", "task.num_eval=4", "task.hidden_size=16",
            "task.num_layers=1", "task.num_heads=2", "task.num_kv_heads=1", "task.intermediate_size=32", "task.sft_steps=4",
            "task.sft_mistake_steps=4", "task.sft_batch_size=4", f"task.workdir={tmp_path / 'tasks'}"]
    proc = tidal_train(tmp_path / "run", task, fault="sigint@sft:step=6")
    assert proc.returncode == EXIT_CODE, proc.stdout[-2000:] + proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("[tidal] warning:")]
    assert len(said) == 1 and said[0].startswith("tidal: stopped by SIGINT while building the task arithmetic-"), proc.stderr[-3000:]
    assert said[0].endswith(": rerun the same command to continue") and "its finished phase(s) 1 are kept" in said[0]
    phases = [p for p in (tmp_path / "tasks").iterdir()]
    assert len(phases) == 1 and phases[0].name.endswith(".phases") and [p.name for p in phases[0].iterdir()] == ["1"]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_one_sigterm_to_every_process_of_the_command_is_one_signal(tmp_path, tiny_task_overrides):
    """Issue 48 item 4: Slurm's `--signal` (and its time limit) signals every process of a job step:
    the `tidal` command and the child it supervises each get SIGTERM, and the command (and torchrun's
    agent, to the command) passes one on. The copies are one signal: the run stops after its step,
    saves it and exits 75 (before, the copies aborted the child at once, with no checkpoint)."""
    import signal
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={out}", *tiny_task_overrides,
           "run.steps=500", "checkpoint.every=0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        (child,) = _children(proc.pid)
        for pid in (proc.pid, child, proc.pid):  # Slurm's to each, then the agent's to the command
            os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_CODE, err[-3000:]
    step = max(metrics(out))
    assert f"stopped by SIGTERM: checkpoint of step {step} saved" in err, err[-3000:]
    assert (out / "checkpoints" / f"step_{step:06d}" / "trainer.json").is_file()
