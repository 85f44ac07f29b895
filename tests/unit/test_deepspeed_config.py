"""DeepSpeed strategy pieces that need no engine: the generated DeepSpeed config (checked by
DeepSpeed's own validator), AdamW parameter groups, config validation, device/accelerator check."""

import os

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

from tidal.config_base import ConfigError  # noqa: E402
from tidal.distributed.runtime import Runtime  # noqa: E402
from tidal.strategy import StrategyConfig, get_strategy  # noqa: E402
from tidal.strategy.deepspeed import DeepSpeedStrategy, deepspeed_config, param_groups  # noqa: E402

BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 2**31 - 1,
    "wall_clock_breakdown": False,
}


def test_cpu_trainable_config_is_fp32_without_accumulation_scaling():
    cfg = deepspeed_config(stage=3, bf16=False, max_grad_norm=1.0, offload_optimizer=False, trainable=True)
    zero = {"stage": 3, "elastic_checkpoint": False, "memory_efficient_linear": False}
    assert cfg == {**BASE, "zero_optimization": zero, "gradient_clipping": 1.0}
    ds = DeepSpeedConfig(cfg)
    assert ds.gradient_accumulation_steps == 1 and not ds.bfloat16_config.enabled and ds.zero_config.stage == 3


def test_bf16_stage2_offload_accumulates_and_reduces_in_fp32():
    cfg = deepspeed_config(stage=2, bf16=True, max_grad_norm=0.5, offload_optimizer=True, trainable=True)
    assert cfg == {
        **BASE,
        "zero_optimization": {"stage": 2, "elastic_checkpoint": False, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    ds = DeepSpeedConfig(cfg)
    assert ds.grad_accum_dtype == "fp32" and ds.communication_data_type == torch.float32
    assert ds.zero_config.offload_optimizer.device == "cpu"


def test_bf16_stage1_fp32_accumulation_only_with_offload():
    # without offload DeepSpeed would route fp32 accumulation to BF16_Optimizer (no offload_states)
    plain = deepspeed_config(stage=1, bf16=True, max_grad_norm=1.0, offload_optimizer=False, trainable=True)
    assert "data_types" not in plain and plain["communication_data_type"] == "fp32"
    offl = deepspeed_config(stage=1, bf16=True, max_grad_norm=1.0, offload_optimizer=True, trainable=True)
    assert offl["data_types"] == {"grad_accum_dtype": "fp32"}
    DeepSpeedConfig(plain)
    DeepSpeedConfig(offl)


def test_frozen_config_has_no_training_settings():
    cfg = deepspeed_config(stage=3, bf16=True, max_grad_norm=1.0, offload_optimizer=False, trainable=False)
    zero = {"stage": 3, "elastic_checkpoint": False, "memory_efficient_linear": False}
    assert cfg == {**BASE, "zero_optimization": zero, "bf16": {"enabled": True}}
    DeepSpeedConfig(cfg)


def test_param_groups_decay_matrices_only_and_skip_frozen_and_empty():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    model[2].weight.requires_grad_(False)
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [id(p) for p in groups[0]["params"]] == [id(model[0].weight)]
    assert [id(p) for p in groups[1]["params"]] == [id(model[0].bias), id(model[1].weight), id(model[1].bias)]
    only_matrices = param_groups(torch.nn.Linear(3, 3, bias=False), 0.0)
    assert len(only_matrices) == 1 and only_matrices[0]["weight_decay"] == 0.0


def test_reshard_after_forward_is_rejected_with_deepspeed():
    with pytest.raises(ConfigError) as e:
        StrategyConfig(backend="deepspeed", reshard_after_forward=False)
    assert e.value.key == "reshard_after_forward"
    StrategyConfig(backend="fsdp2", reshard_after_forward=False)  # still an FSDP2 setting


def _runtime(device: str) -> Runtime:
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device(device), backend="gloo", tp_size=1,
                   tp_rank=0, tp_group=None, dp_rank=0, dp_size=1, dp_group=None, cpu_group=None, tp_cpu_group=None)


def test_accelerator_must_match_the_run_device():
    if deepspeed.accelerator.get_accelerator().device_name() == "cuda":
        pytest.skip("DeepSpeed runs on CUDA here")
    with pytest.raises(ValueError, match="DS_ACCELERATOR=cuda"):
        DeepSpeedStrategy(StrategyConfig(backend="deepspeed"), _runtime("cuda"))


def test_get_strategy_builds_deepspeed_and_sets_local_rank(monkeypatch):
    if deepspeed.accelerator.get_accelerator().device_name() != "cpu":
        pytest.skip("needs DeepSpeed's CPU accelerator")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    strategy = get_strategy(StrategyConfig(backend="deepspeed", zero_stage=2), _runtime("cpu"))
    assert isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage == 2
    assert os.environ["LOCAL_RANK"] == "0"
    with pytest.raises(NotImplementedError):  # ZeRO clips inside its own step
        strategy.clip_and_norm(None)
    with pytest.raises(ValueError, match="not prepared"):
        strategy.offload_model(torch.nn.Linear(2, 2))


def test_hybrid_sharding_is_zero_hpz_at_stage_3_only():
    cfg = deepspeed_config(stage=3, bf16=False, max_grad_norm=1.0, offload_optimizer=False, trainable=True, hpz_partition_size=8)
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert DeepSpeedConfig(cfg).zero_config.zero_hpz_partition_size == 8
    assert "zero_hpz_partition_size" not in deepspeed_config(stage=3, bf16=False, max_grad_norm=1.0, offload_optimizer=False,
                                                             trainable=True)["zero_optimization"]
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        deepspeed_config(stage=2, bf16=False, max_grad_norm=1.0, offload_optimizer=False, trainable=True, hpz_partition_size=8)
