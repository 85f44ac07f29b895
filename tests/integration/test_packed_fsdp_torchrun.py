"""2-rank torchrun (gloo, CPU): packed micro-batches under FSDP2, with unequal micro-batch counts per
rank (equalized with zero-weight passes), accumulate to the unsharded padded gradient (atol 1e-5)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "packed_fsdp.py"


@pytest.mark.slow
def test_packed_fsdp2_two_ranks_equal_padded_gradient(tmp_path):
    env = dict(os.environ, TIDAL_TEST_OUT=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["micro_batches"] > res[1]["micro_batches"]  # rank 1 ran zero-weight passes
    assert res[0]["passes"] == res[1]["passes"] == res[0]["micro_batches"]
    for r in res:
        assert r["grad_scale"] > 1e-3 and r["max_grad_diff"] < 1e-5, r
