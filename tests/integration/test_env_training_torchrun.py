"""2-rank torchrun (gloo, CPU) training with a multi-turn environment whose ranks need different
numbers of turns (tests/integration/uneven_env.py): DP ranks with different row counts
(``env.history: template``) and a rollout TP group (``engine.tp_size=2``) both finish their steps
with the environment's metrics reduced over the ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "dp_template_rows": ["env.history=template", "engine.tp_size=1"],
    "tp2_append": ["env.history=append", "engine.tp_size=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_multi_turn_training_over_two_ranks(name, tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "tidal.cli", "train",
           "quickstart", *tiny_task_overrides, f"run.output_dir={out}", "run.steps=2", "checkpoint.at_end=false",
           "env.name=tests.integration.uneven_env:UnevenEnv", "env.max_turns=4", "train.old_logprobs=recompute", *CASES[name]]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["env/turns_mean"] == 2.0  # rank 0: 1 turn, rank 1: 3 turns, averaged over the ranks
        assert r["env/feedback"] == 1.0 and r["env/finish/done_frac"] == 1.0
        assert r["actor/skipped"] == 0.0 and r["actor/loss"] is not None
