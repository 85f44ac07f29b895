"""PerfMeter: the train phase's FLOPs over real tokens for actor and critic (hand-computed), the
update split and compile metrics in one pop, and the same metrics out of a real training step."""

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

from tidal.logging.timer import PhaseTimer
from tidal.trainer.perf import PerfMeter

CFG = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80, num_hidden_layers=3,
           vocab_size=101, tie_word_embeddings=False)
# per layer: q 48x48, k and v 48x16, o 48x48, gate/up/down 3 x 48x80
LAYER = 48 * 48 * 2 + 2 * 48 * 16 + 3 * 48 * 80


def _models(critic: bool):
    state = lambda m: types.SimpleNamespace(model=m)  # noqa: E731 - PerfMeter reads .model only
    actor = state(AutoModelForCausalLM.from_config(Qwen2Config(**CFG)))
    crit = state(AutoModelForTokenClassification.from_config(Qwen2Config(**CFG, num_labels=1))) if critic else None
    return types.SimpleNamespace(actor=actor, critic=crit)


def _meter(critic: bool, epochs: int = 1) -> PerfMeter:
    return PerfMeter(models=_models(critic), timer=PhaseTimer(sync=lambda: None), device=torch.device("cpu"),
                     compiles=False, compile_cache_dir="off", is_main=True, epochs=epochs)


def test_train_flops_count_real_tokens_of_actor_and_critic_by_hand():
    lens = [5, 9]
    attention = 6 * 3 * 48 * (25 + 81)
    actor = 6 * (3 * LAYER * 14 + 101 * 48 * 14) + attention
    critic = 6 * (3 * LAYER * 14 + 48 * 14) + attention  # a critic's head is one value per token
    assert _meter(critic=False).train_flops(lens) == pytest.approx(actor)
    assert _meter(critic=True, epochs=2).train_flops(lens) == pytest.approx(2 * (actor + critic))


def test_pop_reports_split_and_tflops_without_a_peak_on_cpu():
    meter = _meter(critic=False)
    with meter.split.part("forward"):
        sum(range(1000))
    out = meter.pop([5, 9], train_seconds=2.0)
    assert out["perf/forward_s"] > 0 and out["perf/backward_s"] == 0.0
    assert out["perf/train_tflops"] == pytest.approx(meter.train_flops([5, 9]) / 2.0 / 1e12)
    assert "perf/mfu" not in out and "time/compile" not in out  # no measured peak on the CPU; nothing compiles


@pytest.mark.slow
def test_a_training_step_reports_perf_metrics(tmp_path, tiny_task_overrides):
    from tidal.build import build_trainer
    from tidal.config import load_config
    from tidal.distributed import shutdown

    cfg = load_config("quickstart", tiny_task_overrides + [f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false",
                                                          "eval.at_start=false", "eval.at_end=false", "eval.every=0"])
    trainer = build_trainer(cfg)
    try:
        m = trainer.train_step(0)
    finally:
        shutdown()
    assert m["perf/forward_s"] > 0 and m["perf/backward_s"] > 0 and m["perf/optimizer_s"] > 0
    assert m["perf/forward_s"] + m["perf/backward_s"] + m["perf/optimizer_s"] <= m["time/train"] + 1e-6
    assert m["perf/train_tflops"] > 0
