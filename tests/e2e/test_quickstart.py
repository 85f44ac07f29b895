"""The README's main job: `tidal train quickstart` (shipped config, unchanged) improves held-out
accuracy clearly on CPU."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_quickstart_improves_heldout_accuracy(tmp_path, task_workdir):
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={tmp_path / 'run'}",
           f"task.workdir={task_workdir}", "logging.backends=[jsonl]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "eval at start" in proc.stdout and "eval at end" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/greedy_accuracy"]) for r in rows if "eval/greedy_accuracy" in r]
    assert evals[0][0] == 0  # the start-of-run evaluation is step 0 of metrics.jsonl
    start, end = evals[0][1], evals[-1][1]
    assert f"greedy_accuracy {start:.3g}" in proc.stdout.split("eval at start: ")[1].splitlines()[0]
    assert rows[-1]["step"] == 100 and evals[-1][0] == 100
    assert end >= start + 0.3, (start, evals)  # measured 0.395 -> 0.96
    steps = [r for r in rows if r["step"] > 0]
    assert all(0 < r["engine/ahead_frac"] <= 1 for r in steps)  # the native engine's decode steps scheduled ahead
    first, last = steps[0]["reward/mean"], sum(r["reward/mean"] for r in steps[-10:]) / 10
    assert last > first, (first, last)
