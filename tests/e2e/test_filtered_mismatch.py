"""Filtering through the whole pipeline: with top-k, top-p and min-p on, the trainer scores the
processed distribution the native engine sampled from (tidal/sampling_filter.py), so at step 0
(the engine holds the trainer's weights, fp32 on CPU) the logged rollout-vs-trainer mismatch is
below 1e-5, the mismatch correction's weights are 1 and the KL to the (identical) reference is 0.
Before the shared definition the trainer scored temperature only: 0.1-2 nats."""

import math

import pytest

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown


@pytest.mark.slow  # two tiny runs of one step, ~25 s each
@pytest.mark.parametrize("filters", [["rollout.top_k=5", "rollout.top_p=0.9"], ["rollout.temperature=0.7", "rollout.min_p=0.1"]])
def test_step0_mismatch_is_zero_with_filtering(filters, tmp_path, tiny_task_overrides):
    cfg = load_config("quickstart", tiny_task_overrides + filters + [
        f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false", "train.epochs=2",
        "algorithm.mismatch.mode=token_truncate", "algorithm.kl_coef=0.01", "rollout.max_new_tokens=8"])
    trainer = build_trainer(cfg)
    try:
        metrics = trainer.fit()
    finally:
        shutdown()
    assert metrics["response/tokens_count"] > 0
    assert metrics["mismatch/logp_diff_max"] <= 1e-5, metrics["mismatch/logp_diff_max"]
    assert metrics["mismatch/abs_logp_diff_mean"] <= 1e-5
    assert metrics["actor/mismatch_abs_logp_diff"] <= 1e-5
    assert metrics["actor/mismatch_is_weight"] == pytest.approx(1.0, abs=1e-5)
    assert abs(metrics["kl/rollout"]) <= 1e-6 and math.isfinite(metrics["actor/loss"])
