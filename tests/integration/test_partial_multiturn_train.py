"""rollout.partial.mode=carry with a multi-turn environment, end to end on the tiny arithmetic task
(native engine on CPU): trajectories are carried across steps (their tools run while the trainer
trains), stale tokens are trained, and the per-token correction the update applies equals its
recomputation from each trained token's sampling logprob (of the weights that sampled it) and the
trainer's logprob; the inverted ratio gives other values. A run resumed from a checkpoint starts
the trajectories in flight again from their prompts."""

from pathlib import Path

import pytest

from tests.integration.test_partial_rollout import _metrics, _recomputed_correction, _train

MULTI_TURN = ["env.name=tests.integration.inflight_env:SlowToolEnv", "env.max_turns=4", "env.workers=64",
              "rollout.partial.mode=carry", "algorithm.mismatch.mode=token_truncate", "rollout.partial.oversample=1.0",
              "train.old_logprobs=recompute", "logging.trajectories_every=1", "optim.lr=3e-3"]


@pytest.mark.slow
def test_multi_turn_carry_trains_corrected_stale_tokens(tmp_path: Path, tiny_task_overrides):
    common = tiny_task_overrides + MULTI_TURN + ["checkpoint.every=2", "checkpoint.keep=3"]
    _train(tmp_path / "a", common + ["run.steps=4"])
    a = _metrics(tmp_path / "a", ("reward/", "actor/", "partial/", "env/"))
    assert all(a[s]["partial/carried_groups"] > 0 for s in (1, 2, 3, 4))
    assert all(a[s]["env/turns_mean"] == 3.0 for s in (1, 2, 3, 4))  # whole trajectories are trained
    stale = [s for s in (2, 3, 4) if a[s]["partial/stale_token_frac"] > 0]
    assert stale and all(a[s]["partial/staleness_max"] >= 1 and a[s]["partial/span_max"] >= 2 for s in stale)
    assert max(a[s]["partial/staleness_max"] for s in (1, 2, 3, 4)) <= 4  # max_staleness
    moved = 0
    for s in (1, 2, 3, 4):
        w, inverted, absd, worst = _recomputed_correction(tmp_path / "a", s)
        assert a[s]["actor/mismatch_is_weight"] == pytest.approx(w, rel=1e-5), s
        assert a[s]["actor/mismatch_abs_logp_diff"] == pytest.approx(absd, rel=1e-4, abs=1e-9), s
        if s not in stale:
            assert worst < 1e-4, s
        elif absd > 1e-3:
            moved += 1
            assert abs(w - inverted) > 100 * 1e-5 * w, s
    assert moved
    # resumed after step 3: its groups in flight start again from their prompts (none lost)
    _train(tmp_path / "b", common + ["run.steps=3"])
    _train(tmp_path / "b", common + ["run.steps=4"])
    b = _metrics(tmp_path / "b", ("partial/", "env/"))
    assert b[4]["partial/resumed"] == 0 and b[4]["env/turns_mean"] == 3.0
