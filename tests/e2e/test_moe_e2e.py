"""A tiny Qwen3-MoE quickstart through the whole pipeline (native engine, routing record, replay in
the experience and update forwards, load-balancing loss, weight sync): the MoE metrics are logged,
the aux-loss term follows its coefficient, and with replay the trainer routes as the engine did."""

import math

import pytest
import torch

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown

MOE = ["task.architecture=qwen3_moe", "task.sft_mistake_steps=0", "rollout.ignore_eos=true", "checkpoint.at_end=false",
       "reward.components.correct.path=tests.e2e.rewards:text_hash_reward", "optim.lr=1e-3"]


@pytest.mark.slow
@pytest.mark.parametrize("arch,coef,replay", [("qwen3_moe", "auto", "rollout"), ("qwen3_moe", "0", "off"),
                                              ("qwen3_5_moe", "auto", "rollout")])
def test_moe_quickstart_logs_its_router_and_trains(arch, coef, replay, tmp_path, tiny_task_overrides):
    """Qwen3.5-MoE (a Gated DeltaNet layer, then gated full attention): the hybrid backbone's state
    pool beside the routing record, the same metrics."""
    cfg = load_config("quickstart", tiny_task_overrides + MOE + [
        f"run.output_dir={tmp_path}", "run.steps=2", f"moe.aux_loss_coef={coef}", f"moe.routing_replay={replay}",
        f"task.architecture={arch}"] + (["task.num_layers=2"] if arch == "qwen3_5_moe" else []))
    trainer = build_trainer(cfg)
    try:
        moe = trainer.models.moe
        assert moe is not None and moe.replay == (replay == "rollout")
        assert moe.aux_loss_coef == (0.001 if coef == "auto" else 0.0)  # auto: the config's router_aux_loss_coef
        before = {n: p.detach().clone() for n, p in trainer.models.actor.model.named_parameters()}
        metrics = trainer.fit()
        assert metrics["moe/aux_loss"] > 0 and math.isfinite(metrics["actor/loss"])
        assert metrics["moe/aux_loss_term"] == pytest.approx(moe.aux_loss_coef * metrics["moe/aux_loss"])
        # the engine holds the trainer's weights at every step's start: routing and logprobs agree
        assert metrics["moe/router_agreement"] == 1.0
        assert metrics["actor/mismatch_abs_logp_diff"] < 1e-4
        router = trainer.models.actor.model.model.layers[0].mlp.gate.weight
        assert not torch.equal(router.detach(), before["model.layers.0.mlp.gate.weight"])  # the router learns
    finally:
        shutdown()


@pytest.mark.slow
def test_moe_on_deepspeed_zero3_replays_and_balances(tmp_path, tiny_task_overrides, monkeypatch):
    """The same run with the actor under DeepSpeed ZeRO-3 (partitioned experts and routers): the hooks
    see the gathered routers, replay holds, the aux-loss term is its coefficient times the loss."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    cfg = load_config("quickstart", tiny_task_overrides + MOE + [
        f"run.output_dir={tmp_path}", "run.steps=2", "run.device=cpu", "strategy.backend=deepspeed", "strategy.zero_stage=3",
        "moe.routing_replay=rollout"])
    trainer = build_trainer(cfg)
    try:
        metrics = trainer.fit()
        assert metrics["moe/aux_loss"] > 0 and metrics["moe/router_agreement"] == 1.0
        assert metrics["moe/aux_loss_term"] == pytest.approx(0.001 * metrics["moe/aux_loss"])
        assert metrics["actor/mismatch_abs_logp_diff"] < 1e-4
    finally:
        shutdown()
