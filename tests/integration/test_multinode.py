"""Several nodes and topology changes on CPU with gloo (issue 42 items 3-4): a run resumed on another
number of ranks (4 -> 2 -> 4) continues from its checkpoint."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def launch(nproc: int, out: Path, overrides: list[str], *, rdzv: list[str] | None = None, timeout: int = 400) -> subprocess.CompletedProcess:
    """``tidal launch`` of the quickstart on ``nproc`` local ranks (``--standalone`` unless ``rdzv`` gives the flags)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tidal.cli", "launch", *(rdzv or ["--standalone"]), "--nproc_per_node", str(nproc),
           "train", "quickstart", f"run.output_dir={out}", *overrides]
    return subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_resume_on_fewer_then_more_ranks(tmp_path, tiny_task_overrides):
    """Saved on 4 ranks, resumed on 2 (step 2), then on 4 again (step 3): model and optimizer are
    resharded by DCP and the sampler's position re-split (which global batch each step takes is
    tests/unit/test_data_sampler.py's); the run goes on from each checkpoint."""
    out = tmp_path / "run"
    common = tiny_task_overrides + ["checkpoint.every=1", "checkpoint.keep=3", "optim.lr=1e-3"]
    for nproc, steps in ((4, 1), (2, 2), (4, 3)):
        p = launch(nproc, out, common + [f"run.steps={steps}"])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        if steps > 1:
            was = 4 if nproc == 2 else 2
            assert (f"resuming step_{steps - 1:06d}, saved on {was} ranks (1 node(s) x {was}), on {nproc} ranks "
                    f"(1 node(s) x {nproc}): model and optimizer state resharded") in p.stdout, p.stdout[-2000:]
        record = json.loads((out / "checkpoints" / f"step_{steps:06d}" / "trainer.json").read_text())
        assert record["world"] == {"world_size": nproc, "num_nodes": 1, "ranks_per_node": nproc}
        assert record["sampler"]["items_consumed"] == 4 * steps  # the global batch goes on from where it was
    m = metrics(out)
    assert sorted(m) == [1, 2, 3]
    assert all(math.isfinite(m[s]["reward/mean"]) and math.isfinite(m[s]["actor/loss"]) for s in m)
