"""2-rank torchrun (gloo, CPU): FSDP2 on a VL model where one rank's batch has images and the
other's has none: no hang (the vision tower runs on every rank), logprobs equal the unsharded model's;
a sharded LoRA actor's merged weights equal the unsharded merge and a step changes only adapters."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "vl_fsdp_mixed.py"


@pytest.mark.slow
def test_fsdp2_vl_mixed_image_and_text_ranks(tmp_path, squares_assets):
    env = dict(os.environ, TIDAL_TEST_OUT=str(tmp_path), OMP_NUM_THREADS="1",
               TIDAL_VL_MODEL=squares_assets.model_path, TIDAL_VL_EVAL=squares_assets.eval_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["max_diff"] < 1e-4, r
        assert r["skipped"] == 0.0 and r["grad_norm"] > 0
        assert r["lora_same_names"] and r["lora_merge_diff"] < 1e-6 and r["lora_changed_only_adapters"], r
    assert res[0]["grad_norm"] == res[1]["grad_norm"]
