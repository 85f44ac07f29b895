"""bench/multiturn.py: the synthetic tool environment, the case config it builds, and (slow) its
CPU smoke run with matrix-shaped figures."""

import json
import os
import subprocess
import sys

import pytest

from tidal.config import TidalConfig
from tidal.config_base import build
from tidal.envs import EnvConfig, EnvRow, ModelTurn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import multiturn  # noqa: E402


def test_synthetic_tool_answers_after_its_latency_until_the_last_turn():
    env = multiturn.SyntheticToolEnv(EnvConfig(), turns=2, latency_ms=20, observation_tokens=3, observation_id=7)
    first = env.step(ModelTurn(token_ids=[1], text="", finish_reason="length", index=0))
    assert not first.done and first.observation.token_ids == [7, 7, 7] and first.counters == {"tool_calls": 1.0}
    assert env.step(ModelTurn(token_ids=[1], text="", finish_reason="length", index=1)).done


def test_lognormal_tool_latencies_have_a_ten_fold_p99_and_repeat_per_row_and_turn():
    env = multiturn.SyntheticToolEnv(EnvConfig(), turns=4, latency_ms=10, observation_tokens=1, observation_id=7,
                                     sigma=multiturn.LOGNORMAL_SIGMA)
    draws = []
    for row in range(2000):
        env.reset(EnvRow(prompt_ids=[row, 5], prompt_text=""))
        draws += [env.latency(t) for t in range(3)]
    env.reset(EnvRow(prompt_ids=[0, 5], prompt_text=""))
    assert [env.latency(t) for t in range(3)] == draws[:3]  # the same row and turn, the same latency
    draws.sort()
    median, p99 = draws[len(draws) // 2], draws[int(0.99 * len(draws))]
    assert 0.009 < median < 0.011 and 8 < p99 / median < 12.5


def test_case_config_samples_the_same_tokens_in_one_or_many_turns(tmp_path):
    paths = dict(model_dir=str(tmp_path), tokenizer_dir=str(tmp_path), data=str(tmp_path / "p.jsonl"), vocab_size=512)
    multi = multiturn.case_config(multiturn.Case(turns=4, tool_latency_ms=50), device="cpu", run_dir=str(tmp_path), **paths)
    single = multiturn.case_config(multiturn.Case(turns=1, tool_latency_ms=0), device="cpu", run_dir=str(tmp_path), **paths)
    assert multi["env"]["max_tokens_per_turn"] * 4 == single["rollout"]["max_new_tokens"] == 256
    assert multi["env"]["workers"] == 128 and single["env"] == {"name": "single_turn"}
    build(TidalConfig, multi)  # a valid run config
    inflight = multiturn.case_config(multiturn.Case(turns=4, tool_latency_ms=50, inflight=True), device="cpu",
                                     run_dir=str(tmp_path), **paths)
    cfg = build(TidalConfig, inflight)  # trajectories in flight: carry, a correction, a worker per trajectory in flight
    assert cfg.rollout.partial.mode == "carry" and cfg.algorithm.mismatch.mode == "token_truncate"
    assert cfg.env.workers == 128 * (cfg.rollout.partial.max_staleness + 2)


@pytest.mark.slow
def test_tiny_smoke_run_gives_matrix_shaped_figures(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "multiturn.py"), "--tiny", "--latency-ms", "0,20",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(f["turns"], f["tool_latency_ms"]) for f in figures] == [(1, 0.0), (2, 0.0), (2, 20.0)]
    for f in figures:
        assert f["figure"] == "case" and f["error"] is None and f["iteration_s"] > 0 and "generate" in f["phases"]
    assert all(f["turns_mean"] == 2.0 and f["vs_single_turn"] > 0 and 0 <= f["gpu_idle_frac"] < 1 for f in figures[1:])
