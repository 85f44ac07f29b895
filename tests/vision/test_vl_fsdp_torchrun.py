"""2-rank torchrun (gloo, CPU): FSDP2 on a VL model where one rank's batch has images and the
other's has none: no hang (the vision tower runs on every rank), logprobs equal the unsharded model's;
a sharded LoRA actor's merged weights equal the unsharded merge and a step changes only adapters."""

from pathlib import Path

import pytest

from tests.torchrun_scripts import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "vl_fsdp_mixed.py"


@pytest.mark.slow
def test_fsdp2_vl_mixed_image_and_text_ranks(tmp_path, squares_assets):
    res = run_ranks(SCRIPT, tmp_path, TIDAL_VL_MODEL=squares_assets.model_path, TIDAL_VL_EVAL=squares_assets.eval_path)
    for r in res:
        assert r["max_diff"] < 1e-4, r
        assert r["skipped"] == 0.0 and r["grad_norm"] > 0
        assert r["lora_same_names"] and r["lora_merge_diff"] < 1e-6 and r["lora_changed_only_adapters"], r
    assert res[0]["grad_norm"] == res[1]["grad_norm"]
