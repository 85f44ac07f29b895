"""Exact mode through the whole pipeline (``numerics.exact=true``, docs/exact.md): `tidal train
quickstart` logs a rollout/trainer logprob mismatch of exactly 0.0 at every step, and the first
update's importance ratio is exactly 1 (``actor/approx_kl`` and ``actor/clip_frac`` 0 with one
epoch of one mini-batch). The plain run is a tiny task for a few steps; the slow ones are the
shipped quickstart for 50 steps (dense Qwen2) and short Gemma 3 (sliding window), Qwen3, Qwen3.5
(Gated DeltaNet) and Qwen3-MoE runs,
and the default mode's run beside exact mode's (its mismatch is not 0: the check has power)."""

import json
import os
import subprocess
import sys

import pytest

FAMILY_TINY = [
    "task.digits=1", "task.num_train=160", "task.num_eval=32", "task.hidden_size=64", "task.num_layers=2",
    "task.num_heads=4", "task.num_kv_heads=2", "task.intermediate_size=128", "task.sft_steps=250",
    "task.sft_mistake_steps=80", "task.sft_batch_size=32", "rollout.prompts_per_step=8",
    "rollout.n_samples=4", "rollout.max_new_tokens=3", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
    "checkpoint.every=0", "checkpoint.at_end=false", "logging.backends=[jsonl]",
]


def train(tmp_path, overrides, name="run"):
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={tmp_path / name}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def assert_exact(rows, steps):
    steps_rows = [r for r in rows if "actor/mismatch_abs_logp_diff" in r]
    assert len(steps_rows) == steps
    assert all(r["actor/mismatch_abs_logp_diff"] == 0.0 and r["actor/mismatch_kl"] == 0.0 for r in steps_rows), \
        [(r["step"], r["actor/mismatch_abs_logp_diff"]) for r in steps_rows]
    assert all(r["actor/approx_kl"] == 0.0 and r["actor/clip_frac"] == 0.0 for r in steps_rows)


def test_exact_quickstart_mismatch_is_zero_every_step(tmp_path, tiny_task_overrides):
    rows = train(tmp_path, tiny_task_overrides + ["run.steps=3", "numerics.exact=true", "checkpoint.every=0",
                                                  "checkpoint.at_end=false"])
    assert_exact(rows, 3)


@pytest.mark.slow
@pytest.mark.timeout(2700)
def test_exact_quickstart_50_steps(tmp_path, task_workdir):
    """The shipped quickstart (dense Qwen2), 50 steps: the mismatch is exactly 0.0 at each, and the reward rises."""
    rows = train(tmp_path, [f"task.workdir={task_workdir}", "run.steps=50", "numerics.exact=true", "eval.every=0",
                            "eval.at_start=false", "eval.at_end=false", "checkpoint.every=0", "checkpoint.at_end=false",
                            "logging.backends=[jsonl]"])
    assert_exact(rows, 50)
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(reward[-10:]) / 10 > sum(reward[:10]) / 10, reward


@pytest.mark.slow
@pytest.mark.timeout(2700)
@pytest.mark.parametrize("architecture", ["gemma3", "qwen3", "qwen3_5", "qwen3_moe"])
def test_exact_family_quickstart(tmp_path, architecture):
    """A sliding-window family (Gemma 3), Qwen3 (q/k norms), the Gated DeltaNet hybrid (Qwen3.5) and
    an MoE (Qwen3-MoE, routing replay on: a no-op now), 10 steps each."""
    replay = ["moe.routing_replay=rollout"] if architecture == "qwen3_moe" else []
    rows = train(tmp_path, [f"task.architecture={architecture}", f"task.workdir={tmp_path / 'tasks'}", *FAMILY_TINY,
                            "run.steps=10", "numerics.exact=true", *replay])
    assert_exact(rows, 10)


@pytest.mark.slow
def test_default_mode_mismatch_is_not_zero(tmp_path, tiny_task_overrides):
    rows = train(tmp_path, tiny_task_overrides + ["run.steps=3", "checkpoint.every=0", "checkpoint.at_end=false"])
    assert any(r.get("actor/mismatch_abs_logp_diff", 0.0) > 0.0 for r in rows)
