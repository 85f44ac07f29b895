"""2-rank torchrun (gloo, CPU): FSDP2 sharding, rollout TP group, gather_and_generate and
update_engine_weights (engine weights equal the gathered actor weights, before and after a step)."""

from pathlib import Path

from tests.torchrun_scripts import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_tp_sync.py"


def test_fsdp2_tp_weight_sync(tmp_path):
    res = run_ranks(SCRIPT, tmp_path)
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
