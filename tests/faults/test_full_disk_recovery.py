"""A full disk never leaves a run that cannot resume (issue 35 item 3):

- a save killed after it filled the disk: the rerun settles the partial save before it takes the
  run lock (the lock's file needs the space the partial holds; every rerun used to exit 2 at
  "cannot create the run lock ... No space left on device"), on one rank and on two (gloo); a
  partial save of a live run holding the lock is never touched;
- a torn last line of metrics.jsonl (what ENOSPC during a metrics write leaves): dropped with a
  warning naming the file and line (every rerun used to fail with a bare JSONDecodeError); a bad
  line elsewhere is an error naming file and line.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.config_base import ConfigError
from tidal.distributed.runtime import init_runtime, shutdown
from tidal.logging import MetricsLogger
from tidal.logging.config import LoggingConfig
from tidal.run import checkpoint as ckpt
from tidal.run.run_dir import open_run_dir

from tests.faults.disks import tmpfs

REPO = Path(__file__).resolve().parents[2]




def _killed_save_filled_the_disk(run: Path) -> Path:
    """Step 1 saved, then a save of step 2 written until the kernel said ENOSPC (and killed there)."""
    root = ckpt.checkpoint_root(str(run))
    rt = init_runtime(1, "cpu")
    try:
        ckpt.save_checkpoint(root, 1, model_states={"m": {"w": torch.ones(64)}}, runtime=rt, keep=5,
                             trainer_state={"step": 1, "sampler": {}, "algorithm": {}, "trainer": {}})
    finally:
        shutdown()
    partial = root / "step_000002.tmp"
    (partial / "models").mkdir(parents=True)
    with pytest.raises(OSError, match="No space left on device"), open(partial / "models" / "__0_0.distcp", "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return partial


def test_a_save_that_filled_the_disk_is_settled_before_the_lock(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        run = disk / "run"
        partial = _killed_save_filled_the_disk(run)
        rt = init_runtime(1, "cpu")
        try:
            lock = open_run_dir(str(run), rt, checkpoints=True)  # raised "cannot create the run lock ... No space left"
        finally:
            shutdown()
        assert lock.held and not partial.exists()
        lock.release()


def test_a_live_runs_partial_save_is_left_alone(tmp_path):
    run = tmp_path / "run"
    partial = ckpt.checkpoint_root(str(run)) / "step_000002.tmp"
    partial.mkdir(parents=True)
    hold = "import sys, time; from tidal.run.run_lock import acquire_run_lock; acquire_run_lock(sys.argv[1], 0); print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", hold, str(run)], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        rt = init_runtime(1, "cpu")
        try:
            with pytest.raises(ConfigError, match="in use by another run"):
                open_run_dir(str(run), rt, checkpoints=True)
        finally:
            shutdown()
        assert partial.is_dir()  # it may be that run's save in progress
    finally:
        proc.kill()
        proc.wait()


def test_two_ranks_settle_a_full_disk_before_the_lock(tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        run = disk / "run"
        partial = _killed_save_filled_the_disk(run)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "tests" / "faults" / "scripts" / "claim_full_disk.py"), str(run)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "CLAIMED rank 0 held True resume 1" in proc.stdout and "CLAIMED rank 1 held False resume 1" in proc.stdout
        assert not partial.exists()


def _logger(run: Path, start_step: int) -> MetricsLogger:
    return MetricsLogger(LoggingConfig(backends=["jsonl"]), run, is_main=True, total_steps=10, start_step=start_step)


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.6}\n{"step": 3, "rew')
    logger = _logger(tmp_path, 2)  # raised a bare JSONDecodeError naming no file
    logger.log(3, {"reward": 0.7})
    logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    err = capsys.readouterr().err
    assert f"warning: {path}:3: the last line is not a whole record" in err


def test_a_bad_line_before_the_last_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"{path}:2 is not a metrics record"):
        _logger(tmp_path, 2)
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'  # left for the user to repair


def test_a_checkpoints_folder_made_read_only_mid_run_is_one_line_and_the_rerun_resumes(tmp_path, tiny_task_overrides,
                                                                                      monkeypatch, capsys):
    """Issue 51 item 8: the checkpoints folder remounted read-only during step 2 was a raw 38-line
    OSError traceback; it is one line naming the step, the error and that the previous checkpoint is
    intact, exit 1; writable again, the same command resumes from step 1."""
    from tests.faults import rewards
    from tidal import cli

    run = tmp_path / "run"
    with tmpfs(run / "checkpoints", "64m") as checkpoints:
        monkeypatch.setenv("TIDAL_TEST_RO", str(checkpoints))
        monkeypatch.setitem(rewards.CALLS, "n", 0)
        args = ["train", "quickstart", *tiny_task_overrides, f"run.output_dir={run}", "run.steps=3", "checkpoint.every=1"]
        code = cli.main([*args, "reward.components.correct.path=tests.faults.rewards:checkpoints_read_only_at_step_2"])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err, err[-3000:]
        said = err.strip().splitlines()[-1]
        assert said.startswith(f"tidal: saving checkpoint step 2 into {checkpoints / 'step_000002.tmp'} failed: OSError: "
                               "[Errno 30] Read-only file system") and said.endswith("the previous checkpoint is intact"), said
        assert [p.name for p in checkpoints.iterdir()] == ["step_000001"]
        subprocess.run(["mount", "-o", "remount,rw", str(checkpoints)], check=True)
        assert cli.main([*args, "reward.components.correct.path=tests.faults.rewards:text_hash_reward"]) == 0
        assert f"resumed from {checkpoints / 'step_000001'} (step 1)" in capsys.readouterr().out
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
