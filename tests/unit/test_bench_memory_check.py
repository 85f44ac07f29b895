"""bench/memory_check.py: the GPU comparison of predicted and measured peaks (its pure parts here;
``--tiny`` runs the whole script on CPU)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import memory_check  # noqa: E402

from tidal.memory.plan import GiB, MemoryPlan, PhasePeak, Part  # noqa: E402


def test_phase_peaks_and_comparison():
    points = [
        {"label": "generate:start"}, {"label": "generate:end", "peak": 40 * GiB},
        {"label": "actor_logprobs:end", "peak": 50 * GiB}, {"label": "reference_logprobs:end", "peak": 55 * GiB},
        {"label": "train:end", "peak": 100 * GiB}, {"label": "weight_sync:end", "peak": 45 * GiB},
        {"label": "train:end", "peak": 101 * GiB},  # a second update: the larger counts
    ]
    peaks = memory_check.phase_peaks(points)
    assert peaks == {"generate": 40.0, "actor_logprobs": 50.0, "reference_logprobs": 55.0, "train": 101.0, "weight_sync": 45.0}
    phases = tuple(PhasePeak(n, (Part("x", int(g * GiB)), Part("context", GiB, allocated=False)))
                   for n, g in [("rollout", 41), ("experience", 54), ("update", 99), ("optimizer step", 60), ("weight sync", 44)])
    plan = MemoryPlan(inputs=None, choice=None, phases=phases, host_parts=(), host_setup_bytes=0)
    got = memory_check.compare(plan, peaks)
    assert got["rollout"] == {"predicted_gib": 41.0, "measured_gib": 40.0}
    assert got["experience"]["measured_gib"] == 55.0 and got["update"]["measured_gib"] == 101.0


def test_shapes_are_the_qwen25_configs():
    from tidal.memory.plan import ModelShape

    assert round(ModelShape.from_hf_config(memory_check.SHAPES["7b"]).params() / 1e9, 2) == 7.62
    assert round(ModelShape.from_hf_config(memory_check.SHAPES["0.5b"]).params() / 1e9, 2) == 0.49


@pytest.mark.slow
def test_tiny_run_on_cpu(tmp_path, monkeypatch):
    """The whole script on a tiny model on CPU: one step record per iteration and a summary with the
    plan (made for --device-gib, the same the run resolved its settings with), nothing measured."""
    from tidal.distributed.runtime import shutdown

    monkeypatch.chdir(tmp_path)
    record = tmp_path / "memory_check.jsonl"
    try:
        summary = memory_check.run(memory_check.parse_args([
            "--tiny", "--sequences", "8", "--samples", "4", "--prompt-len", "8", "--new-tokens", "8", "--steps", "2",
            "--workdir", str(tmp_path / "work"), "--record", str(record)]))
    finally:
        shutdown()
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["step", "step", "summary"]
    assert summary["fits"] and summary["measured_peak_gib"] is None and "memory plan" in summary["plan"]
    assert summary["same_choice"] and summary["predicted_peak_gib"] > 0  # the plan made beforehand is the run's
    assert set(lines[0]["phases"]) >= {"rollout", "experience", "update", "optimizer step", "weight sync"}
