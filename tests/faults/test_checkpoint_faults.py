"""SIGKILL (and a full disk) at every point of a checkpoint save: the newest checkpoint that loads
afterwards is the previous one (or the new one, once renamed into place), its values are intact,
and whatever the interrupted save left behind is removed before the next save."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run import checkpoint as ckpt

WORKER = Path(__file__).parent / "scripts" / "ckpt_worker.py"
REPO = Path(__file__).resolve().parents[2]


def _save(root: Path, saves: list[str], fault: str = "", keep: int = 3) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIDAL_FAULT=fault, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("RANK", None)
    cmd = [sys.executable, str(WORKER), str(root), str(keep), *saves]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _resume(root: Path) -> tuple[int, float]:
    """What PPOTrainer.maybe_resume does: clean partial saves, pick the newest complete one, load it."""
    ckpt.clean_partial(root)
    path = ckpt.resolve_resume("auto", root, required_keys=("step", "value"))
    assert path is not None, sorted(p.name for p in root.iterdir())
    states = {"m": {"w": torch.zeros(4)}}
    state = ckpt.load_checkpoint(path, model_states=states, rank=0)
    w = states["m"]["w"]
    assert torch.equal(w, torch.full((4,), float(state["value"]))), (w, state)
    return int(state["step"]), float(state["value"])


CASES = {
    # point hit -> (saves, checkpoint that must load afterwards as (step, value))
    "begin": (["1:1", "2:2"], (1, 1.0)),
    "shards": (["1:1", "2:2"], (1, 1.0)),
    "marker": (["1:1", "2:2"], (1, 1.0)),
    "swapped": (["1:1", "2:2", "2:3"], (2, 2.0)),  # re-saving step 2: the old step_2 was moved aside
    "renamed": (["1:1", "2:2"], (2, 2.0)),  # renamed into place: the new one is complete
    "rotating": (["1:1", "2:2"], (2, 2.0)),  # keep=1: step_1 is being deleted
}


@pytest.mark.parametrize("point", sorted(CASES))
def test_sigkill_during_checkpoint_write(tmp_path, point):
    saves, expected = CASES[point]
    root = tmp_path / "checkpoints"
    proc = _save(root, saves, fault=f"kill@checkpoint/{point}:step=2", keep=1 if point == "rotating" else 3)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert f"SIGKILL rank 0 at checkpoint/{point} step 2" in proc.stdout
    assert _resume(root) == expected
    leftovers = sorted(p.name for p in root.iterdir() if not ckpt._STEP_RE.match(p.name))
    assert leftovers == [], leftovers
    # the run goes on: the next save works and leaves only complete checkpoints
    rt = init_runtime(1, "cpu")
    try:
        ckpt.save_checkpoint(root, 3, model_states={"m": {"w": torch.full((4,), 7.0)}},
                             trainer_state={"step": 3, "value": 7}, runtime=rt, keep=2)
    finally:
        shutdown()
    assert _resume(root) == (3, 7.0)
    names = sorted(p.name for p in root.iterdir())
    assert names == [f"step_{expected[0]:06d}", "step_000003"], names


def test_disk_full_during_checkpoint_write(tmp_path):
    root = tmp_path / "checkpoints"
    proc = _save(root, ["1:1", "2:2"], fault="enospc@checkpoint/shards:step=2")
    assert proc.returncode == 1
    assert "No space left on device" in proc.stderr
    assert _resume(root) == (1, 1.0)
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]
