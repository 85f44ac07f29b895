"""The memory plan wired into a run (CPU): its settings reach every component that reads them (the
Strategy and its optimizer, the phase owner, gradient checkpointing of actor and critic, the update
and experience micro-batches), the engine left to size its own KV cache, a plan made for a given device size is
applied, and a run that cannot fit stops before any model loads, naming the key to change."""

import dataclasses
import math

import pytest

import tidal.build
from tidal.build import build_trainer
from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.distributed import shutdown
from tidal.strategy.streamed_adamw import StreamedAdamW
from tidal.memory.plan import MemorySettings


def _checkpointing(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.slow
def test_every_component_reads_the_plans_settings(tmp_path, tiny_task_overrides, monkeypatch):
    """Settings as a plan would choose them on a small device (checkpointing, the optimizer state on
    the host, the engine's weights parked between rollouts, small budgets): each reaches the
    component that uses it, the engine's section is the user's but for the sleep level, and a step runs."""
    planned = MemorySettings(micro_batch_tokens=70, forward_micro_batch_tokens=90, gradient_checkpointing=True,
                             offload_optimizer=True, sleep_level=2)
    seen = {}

    def fake_plan_run(cfg, hf_config, **kw):
        seen.update(kw, cfg=cfg)
        return planned

    monkeypatch.setattr(tidal.build, "plan_run", fake_plan_run)
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false", "algorithm.advantage=gae",
    ])
    trainer = build_trainer(cfg)
    try:
        assert seen["needs_critic"] and not seen["needs_reference"] and seen["teacher_hf_config"] is None
        assert seen["cfg"] is cfg and cfg.train.micro_batch_tokens == "auto"  # planned from the config as written
        assert trainer.cfg.train.micro_batch_tokens == 70 and trainer.updater.train_cfg.micro_batch_tokens == 70
        assert trainer.maker.train_cfg.forward_micro_batch_tokens == 90
        assert trainer.colocation.strategy.cfg.offload_optimizer is True and trainer.colocation._offload_optimizer is True
        assert isinstance(trainer.models.actor.optimizer, StreamedAdamW)
        assert isinstance(trainer.models.critic.optimizer, StreamedAdamW)
        assert _checkpointing(trainer.models.actor.model) and _checkpointing(trainer.models.critic.model)
        # the KV budget is the engine's to size (the plan predicts it); what its sleep frees is the plan's
        assert trainer.cfg.engine == dataclasses.replace(cfg.engine, sleep_level=2) and cfg.engine.sleep_level == "auto"
        assert trainer.colocation.sleep_level == 2
        metrics = trainer.fit()
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["critic/value_loss"])
    finally:
        shutdown()


@pytest.mark.slow
def test_a_plan_for_a_given_device_is_applied_on_cpu(tmp_path, tiny_task_overrides, capsys):
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "run.steps=1", "checkpoint.at_end=false", "memory.device_memory_gib=80",
        "memory.host_memory_gib=64",
    ])
    trainer = build_trainer(cfg)
    try:
        out = capsys.readouterr().out
        assert "memory plan: 80 GiB device (memory.device_memory_gib)" in out and "train.micro_batch_tokens=" in out
        # a tiny model on 80 GiB: the budgets take a whole rank's mini-batch, no checkpointing, state on the device
        rows, max_len = 16, cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
        assert trainer.updater.train_cfg.micro_batch_tokens == rows * max_len
        assert trainer.colocation.strategy.cfg.offload_optimizer is False
        assert not _checkpointing(trainer.models.actor.model)
        # the trainer carries the settings and plan it was built with (the bench reads the predicted peak there)
        assert trainer.memory.micro_batch_tokens == rows * max_len and trainer.memory.plan.predicted_peak_allocated_gib > 0
        trainer.fit()
    finally:
        shutdown()


@pytest.mark.slow
def test_a_run_that_cannot_fit_stops_before_loading_a_model(tmp_path, tiny_task_overrides, monkeypatch):
    loads = []
    monkeypatch.setattr(tidal.build, "load_causal_lm", lambda *a, **k: loads.append(a))
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "memory.device_memory_gib=1.2", "memory.host_memory_gib=64",
    ])
    try:
        with pytest.raises(ConfigError) as e:
            build_trainer(cfg)
    finally:
        shutdown()
    assert "does not fit in memory" in e.value.message and e.value.key
    assert not loads
