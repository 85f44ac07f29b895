"""2-rank torchrun (gloo, CPU): FSDP2 sharding, rollout TP group, gather_and_generate and
update_engine_weights (engine weights equal the gathered actor weights, before and after a step)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_tp_sync.py"


def test_fsdp2_tp_weight_sync(tmp_path):
    env = dict(os.environ, TIDAL_TEST_OUT=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, x in enumerate(res):
        assert x["tp_ranks"] == [0, 1] and x["tp_rank"] == r and x["dp_size"] == 1
        assert x["sharded"]
        assert x["gather_equal"] and x["gather_odd_equal"], x
        assert 1 < x["gather_collectives"] < x["gather_requests"] / 2 and x["gather_odd_collectives"] == 1, x
        for tag in ("before", "after"):
            assert x[f"{tag}_plain_equal"], (r, tag)
            assert x[f"{tag}_n_outputs"] == 2 + r  # each rank gets back exactly its own prompts
            assert x[f"{tag}_prompts_match"], (r, tag)
            assert x[f"{tag}_native_eq_hf"], (r, tag)
        assert x["changed"]
        assert x["step"]["skipped"] == 0.0
    assert res[0]["step"]["grad_norm"] == res[1]["step"]["grad_norm"]
