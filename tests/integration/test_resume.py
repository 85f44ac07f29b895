"""Exact resume: a run stopped after step 2 and resumed (resume: auto) logs the same metrics for
steps 3-4 as an uninterrupted 4-step run; partial checkpoints are ignored and cleaned."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DETERMINISTIC = ("reward/", "actor/", "response/", "advantage/", "mismatch/")


def _train(out: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(DETERMINISTIC) and not k.endswith("seconds")} for r in rows}


@pytest.mark.slow
def test_resume_matches_uninterrupted(tmp_path, tiny_task_overrides):
    common = tiny_task_overrides + ["checkpoint.every=2", "checkpoint.keep=3", "optim.lr=1e-3"]
    _train(tmp_path / "a", common + ["run.steps=4"])
    _train(tmp_path / "b", common + ["run.steps=2"])
    # a crash during a later save leaves a partial directory: it must be ignored and removed
    partial = tmp_path / "b" / "checkpoints" / "step_000004.tmp"
    partial.mkdir()
    (partial / "junk").write_text("x")
    _train(tmp_path / "b", common + ["run.steps=4"])
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert a[step].keys() == b[step].keys()
        for k, v in a[step].items():
            assert v == pytest.approx(b[step][k], rel=1e-6, abs=1e-9), (step, k)
    ckpts = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]
