"""PhaseTimer accumulation with a fake clock, CUDA sync hook; TrajectoryWriter files."""

import json

import numpy as np
import torch

from tidal.logging import PhaseTimer, TrajectoryWriter


def test_phases_accumulate_and_pop_resets():
    ticks = iter([0.0, 1.5, 2.0, 2.25, 10.0, 11.0, 12.0, 13.0])  # update: 10..13, inner: 11..12
    syncs = []
    timer = PhaseTimer(clock=lambda: next(ticks), sync=lambda: syncs.append(1))
    with timer.phase("generate"):
        pass
    with timer.phase("generate"):
        pass
    with timer.phase("update"):
        with timer.phase("inner"):
            pass
    assert timer.pop() == {"time/generate": 1.75, "time/update": 3.0, "time/inner": 1.0}
    assert timer.pop() == {} and len(syncs) == 8


def test_phase_counts_time_when_the_block_raises():
    ticks = iter([0.0, 2.0])
    timer = PhaseTimer(clock=lambda: next(ticks), sync=lambda: None)
    try:
        with timer.phase("reward"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert timer.pop() == {"time/reward": 2.0}


def test_default_sync_uses_cuda_only_when_initialized(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append(1))
    with PhaseTimer().phase("x"):
        pass
    assert len(calls) == 2


def test_trajectory_writer(tmp_path):
    records = [{"prompt": "p", "response": "r", "reward": torch.tensor(1.0), "logprobs": np.array([-0.5, -1.0])}]
    path = TrajectoryWriter(tmp_path).write(12, records)
    assert path == tmp_path / "trajectories" / "step_000012.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"prompt": "p", "response": "r", "reward": 1.0, "logprobs": [-0.5, -1.0]}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_000012.jsonl"]
