"""2-rank torchrun (gloo, CPU): packed micro-batches under FSDP2, with unequal micro-batch counts per
rank (equalized with zero-weight passes), accumulate to the unsharded padded gradient (atol 1e-5)."""

from pathlib import Path

import pytest

from tests.torchrun_scripts import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "packed_fsdp.py"


@pytest.mark.slow
def test_packed_fsdp2_two_ranks_equal_padded_gradient(tmp_path):
    res = run_ranks(SCRIPT, tmp_path)
    assert res[0]["micro_batches"] > res[1]["micro_batches"]  # rank 1 ran zero-weight passes
    assert res[0]["passes"] == res[1]["passes"] == res[0]["micro_batches"]
    for r in res:
        assert r["grad_scale"] > 1e-3 and r["max_grad_diff"] < 1e-5, r
