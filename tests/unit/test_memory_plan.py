"""The memory plan (``tidal.memory.plan``): hand-computed byte counts of a tiny shape, the
Qwen2.5 shapes on one H200, the measured H200 peaks it must reproduce, explicit settings kept and
checked, errors that name what to change, the host budget, and the ``auto`` config values."""

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from tidal.build import check_context_budget
from tidal.config import load_config
from tidal.config_base import ConfigError, build
from tidal.engine.config import EngineConfig
from tidal.memory.config import MemoryConfig
from tidal.models.config import ModelConfig
from tidal.strategy.config import StrategyConfig
from tidal.trainer.config import RolloutConfig, TrainConfig
from tidal.host_memory import cgroup_limit, host_memory, meminfo_total
from tidal.memory.plan import (
    GiB,
    MIN_EFFICIENT_MICRO_BATCH_TOKENS,
    MiB,
    DeviceMemory,
    HostMemory,
    ModelShape,
    PlanInputs,
    apply_plan,
    forward_activation_bytes,
    layer_backward_bytes,
    layer_saved_bytes,
    lora_params,
    plan_memory,
    settings_without_plan,
    train_activation_bytes,
)
from tidal.memory.probe import make_plan, plan_run

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# config.json of the public Qwen2.5 checkpoints (hidden, layers, heads, kv heads, intermediate, vocab, tied)
QWEN25 = {
    "0.5b": dict(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936, tied_embeddings=True),
    "1.5b": dict(layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936, tied_embeddings=True),
    "3b": dict(layers=36, hidden=2048, heads=16, kv_heads=2, head_dim=128, intermediate=11008, vocab=151936, tied_embeddings=True),
    "7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064, tied_embeddings=False),
}
H200 = DeviceMemory(name="NVIDIA H200", total=int(139.8 * GiB), context=600 * MiB)
HOST = HostMemory(total=128 * GiB, source="test")
TINY = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32, tied_embeddings=True, qkv_bias=True)


def qwen(size: str) -> ModelShape:
    return ModelShape(**QWEN25[size], qkv_bias=True, model_type="qwen2")


# a test's knob -> the config key it sets (every other value is its section's own default)
KEYS = {
    "lora_rank": "model.lora.rank", "lora_targets": "model.lora.target_modules", "gradient_checkpointing": "model.gradient_checkpointing",
    "micro_batch_tokens": "train.micro_batch_tokens", "micro_batch_max_seqs": "train.micro_batch_max_seqs",
    "offload_optimizer": "strategy.offload_optimizer", "offload_teacher": "strategy.offload_teacher",
    "kv_cache_max_tokens": "engine.kv_cache_max_tokens", "kv_cache_memory_fraction": "engine.kv_cache_memory_fraction",
    "sleep_level": "engine.sleep_level", "device_fraction": "memory.device_fraction", "max_new_tokens": "rollout.max_new_tokens",
}
SECTIONS = {"train": TrainConfig, "model": ModelConfig, "strategy": StrategyConfig, "engine": EngineConfig, "rollout": RolloutConfig,
            "memory": MemoryConfig}


def plan_inputs(shape: ModelShape, *, sequences_per_rank: int, max_prompt_len: int, world_size: int = 1, **kw) -> PlanInputs:
    """PlanInputs of real config sections: ``sequences_per_rank`` rows per rank (one sample per
    prompt), the knobs of :data:`KEYS` set, the rest of ``kw`` PlanInputs' own fields."""
    sections: dict = {name: {} for name in SECTIONS}
    sections["rollout"] = {"prompts_per_step": sequences_per_rank * world_size, "n_samples": 1}
    for knob in [k for k in kw if k in KEYS]:
        node = sections
        *path, leaf = KEYS[knob].split(".")
        for part in path:
            node = node.setdefault(part, {})
        value = kw.pop(knob)
        node[leaf] = list(value) if isinstance(value, tuple) else value
    built = {name: build(cls, sections[name], name) for name, cls in SECTIONS.items()}
    return PlanInputs(shape=shape, max_prompt_len=max_prompt_len, world_size=world_size, **{**built, **kw})


def inputs(size: str, **kw) -> PlanInputs:
    """The issue's workload: 256 sequences of 256 prompt + 1024 new tokens on one H200."""
    base = dict(sequences_per_rank=256, max_prompt_len=256, max_new_tokens=1024, device=H200, host=HOST)
    return plan_inputs(qwen(size), **{**base, **kw})


# ---- hand-computed ------------------------------------------------------------------------------------
def test_tiny_shape_counts_by_hand():
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8 = 576; q/k/v biases 16; two norms 16
    assert TINY.layer_params() == 576 + 16 + 16 == 608
    assert TINY.params() == 2 * 608 + 32 * 8 + 8 == 1480  # tied embedding once, final norm
    assert TINY.kv_cache_bytes_per_token() == 2 * 2 * 4 * 2 == 32  # layers x (K, V) x kv_dim x bf16
    # LoRA r=2 on all seven projections: r * (in + out) summed, per layer
    assert lora_params(TINY, 2, ALL_TARGETS) == 2 * 2 * (16 + 12 + 12 + 16 + 24 + 24 + 24) == 512
    assert lora_params(TINY, 2, ("q_proj", "v_proj")) == 2 * 2 * (16 + 12)
    # saved per token per layer: eager 16H + 4Q + 4K + 8I + 4n + 8, compiled 8H + 4Q + 4K + 6I + 4n + 8
    assert layer_saved_bytes(TINY, compiled=False) == 128 + 32 + 16 + 128 + 8 + 8 == 320
    assert layer_saved_bytes(TINY, compiled=True) == 64 + 32 + 16 + 96 + 8 + 8 == 224
    # LoRA: each adapter keeps its [T, r] input of lora_B; the frozen norms do not keep their bf16 input (eager)
    assert layer_saved_bytes(TINY, compiled=False, lora_rank=2, lora_targets=7) == 320 - 4 * 8 + 2 * 2 * 7
    # a micro-batch of 100 tokens, 50 through the LM head, when its backward starts: every layer's
    # saved tensors, final norm (6H + 4) and loss terms (64) per token; the LM head's input and
    # statistics (2H + 72) per response token
    kw = dict(compiled=False, checkpointing=False)
    assert train_activation_bytes(TINY, 100, response_tokens=50, **kw) == 100 * (2 * 320 + 52 + 64) + 50 * 88
    assert layer_backward_bytes(TINY, 100, **kw) == 100 * 3 * 16  # a layer's gradient buffers (3I)
    # checkpointed: every layer's input (2H); the backward recomputes one layer
    kw = dict(compiled=False, checkpointing=True)
    assert train_activation_bytes(TINY, 100, response_tokens=50, **kw) == 100 * (2 * 2 * 8 + 52 + 64) + 50 * 88
    assert layer_backward_bytes(TINY, 100, **kw) == 100 * (3 * 16 + 320)
    # no-grad forward: the larger of a layer's buffers (6I + 8H + 64) and the LM head's inputs and
    # one chunk of logits (eager 14 bytes per logit)
    assert forward_activation_bytes(TINY, 100, response_tokens=50, chunk_rows=50, compiled=False) == \
        max(100 * (96 + 64 + 64), 100 * (16 + 64) + 50 * 32 + 14 * 50 * 32)


def test_shape_from_hf_configs():
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=100, tie_word_embeddings=False)
    shape = ModelShape.from_hf_config(cfg)
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (3, 64, 4, 2, 16)
    assert shape.qkv_bias and not shape.tied_embeddings and not shape.qk_norm
    from transformers import AutoModelForCausalLM

    assert shape.params() == sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    # config.json as a dict, a vision-language layout (decoder numbers under text_config)
    vl = {"model_type": "qwen2_vl", "tie_word_embeddings": True, "text_config": {
        "model_type": "qwen2_vl_text", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 64, "vocab_size": 50}}
    s = ModelShape.from_hf_config({**vl, "vision_config": {"depth": 2}})
    assert (s.hidden, s.kv_heads, s.tied_embeddings, s.qkv_bias, s.vision) == (32, 4, True, True, True)
    plan = plan_memory(plan_inputs(s, sequences_per_rank=8, max_prompt_len=16, max_new_tokens=16, device=H200, host=HOST))
    assert any("vision tower" in n for n in plan.notes)


# ---- what the GPU measured -------------------------------------------------------------------------------
@pytest.mark.parametrize("size,rows,prompt,new,tokens,measured_gib", [
    # bench/results/e2e_grpo.jsonl, be3c9fd: 16 x 8 sequences of 128 + 256 forced tokens, compiled FSDP2
    ("0.5b", 128, 128, 256, 24576, 33.34),  # two micro-batches of 64 rows (gradients present)
    ("0.5b", 128, 128, 256, 49152, 53.95),  # one micro-batch of 128 rows
    # issue 21: 256 sequences of 256 + 1024 forced tokens, 38-row micro-batches
    ("1.5b", 256, 256, 1024, 48640, 122.7),
])
def test_reproduces_measured_h200_peaks(size, rows, prompt, new, tokens, measured_gib):
    inp = plan_inputs(dataclasses.replace(qwen(size), tied_embeddings=True), sequences_per_rank=rows, max_prompt_len=prompt,
                     max_new_tokens=new, micro_batch_tokens=tokens, micro_batch_max_seqs=128,
                     gradient_checkpointing=False, offload_optimizer=False, device=H200, host=HOST)
    plan = plan_memory(inp)
    assert plan.fits
    assert plan.predicted_peak_allocated_gib == pytest.approx(measured_gib, rel=0.05)


# ---- the Qwen2.5 sizes on one H200 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", ["0.5b", "1.5b", "3b"])
def test_small_models_fit_without_checkpointing_or_offload(size):
    plan = plan_memory(inputs(size))
    c = plan.choice
    assert plan.fits and not c.gradient_checkpointing and not c.offload_optimizer
    assert c.micro_batch_tokens >= MIN_EFFICIENT_MICRO_BATCH_TOKENS
    assert plan.peak_bytes <= 0.9 * H200.total
    assert set(plan.chosen()) >= {"train.micro_batch_tokens", "model.gradient_checkpointing", "strategy.offload_optimizer"}


def test_3b_at_512_sequences_fits_with_defaults():
    plan = plan_memory(inputs("3b", sequences_per_rank=512, max_new_tokens=1024))
    assert plan.fits and not plan.choice.gradient_checkpointing and not plan.choice.offload_optimizer
    assert plan.peak_bytes <= 0.9 * H200.total


def test_7b_full_fine_tune_plans_checkpointing_and_optimizer_offload():
    plan = plan_memory(inputs("7b"))
    assert plan.fits, plan.table()
    assert plan.choice.gradient_checkpointing and plan.choice.offload_optimizer
    assert plan.peak_bytes <= 0.9 * H200.total
    step = next(p for p in plan.phases if p.name == "optimizer step")
    labels = {p.label for p in step.parts}
    assert "actor optimizer state" not in labels and "optimizer state staging (streamed)" in labels
    host = {p.label: p.nbytes for p in plan.host_parts}
    assert host["actor optimizer state (pinned)"] == 8 * qwen("7b").params()  # both fp32 moments, exactly
    # AdamW state on the device would not fit beside the engine's weights: the same run with it and
    # the engine's weights kept between rollouts (both given) refused, naming the setting
    with pytest.raises(ConfigError) as e:
        apply_plan(plan_memory(inputs("7b", offload_optimizer=False, sleep_level=1)))
    assert e.value.key == "strategy.offload_optimizer" and "memory plan" in str(e.value)


def test_7b_lora_fits_without_offload():
    plan = plan_memory(inputs("7b", lora_rank=16, lora_targets=ALL_TARGETS))
    assert plan.fits and not plan.choice.offload_optimizer
    update = next(p for p in plan.phases if p.name == "update")
    # FSDP2 keeps the frozen base as sharded fp32 masters; only the adapters have grads and moments
    parts = {p.label: p.nbytes for p in update.parts}
    n_lora = lora_params(qwen("7b"), 16, ALL_TARGETS)
    assert parts["actor weights"] == 4 * (qwen("7b").params() + n_lora)
    assert parts["actor optimizer state"] == 8 * n_lora


@pytest.mark.parametrize("size,new", [("0.5b", 1024), ("1.5b", 30000), ("7b", 8192)])
def test_auto_budgets_hold_the_longest_sequence(size, new):
    """Packed micro-batches never split a sequence: an ``auto`` budget is at least
    data.max_prompt_len + rollout.max_new_tokens (the config check TidalConfig makes of explicit ones)."""
    plan = plan_memory(inputs(size, max_new_tokens=new))
    assert plan.fits, plan.table()
    assert plan.choice.micro_batch_tokens >= 256 + new and plan.choice.forward_micro_batch_tokens >= 256 + new


def test_one_longest_sequence_that_cannot_fit_says_what_to_change():
    with pytest.raises(ConfigError) as e:
        apply_plan(plan_memory(inputs("3b", max_new_tokens=400_000, gradient_checkpointing=False)))
    assert e.value.key == "model.gradient_checkpointing"
    assert "a packed micro-batch of one longest sequence (400256 tokens) already does not fit" in e.value.message
    assert "rollout.max_new_tokens" in e.value.message


def test_more_ranks_shard_the_state():
    one, eight = plan_memory(inputs("7b")), plan_memory(inputs("7b", world_size=8, local_world_size=8, host=HostMemory(total=560 * GiB, source="test")))
    assert eight.fits and not eight.choice.offload_optimizer  # 1/8 of the state fits on the device
    w1 = next(p.nbytes for p in one.phases[2].parts if p.label == "actor weights")
    w8 = next(p.nbytes for p in eight.phases[2].parts if p.label == "actor weights")
    assert w8 == w1 // 8


# ---- explicit settings are kept and checked ---------------------------------------------------------------------
def test_explicit_settings_are_kept():
    plan = plan_memory(inputs("1.5b", micro_batch_tokens=8192, gradient_checkpointing=True, offload_optimizer=True))
    c = plan.choice
    assert (c.micro_batch_tokens, c.gradient_checkpointing, c.offload_optimizer) == (8192, True, True)
    assert "train.micro_batch_tokens" not in plan.chosen() and "strategy.offload_optimizer" not in plan.chosen()
    settings = apply_plan(plan)
    assert (settings.micro_batch_tokens, settings.gradient_checkpointing, settings.offload_optimizer) == (8192, True, True)


def test_explicit_micro_batch_that_cannot_fit_is_an_error_naming_it():
    with pytest.raises(ConfigError) as e:
        apply_plan(plan_memory(inputs("3b", micro_batch_tokens=81920, gradient_checkpointing=False)))
    assert e.value.key == "train.micro_batch_tokens"
    assert "update phase needs" in e.value.message and "OVER BUDGET" in e.value.message


def test_a_budget_one_byte_too_small_is_refused_with_the_key_to_change():
    """Every setting given (nothing left to choose, the KV cache capped): the largest phase fits a
    budget of exactly its bytes and is refused, naming the setting to change, one byte below."""
    given = dict(micro_batch_tokens=32768, gradient_checkpointing=False, offload_optimizer=False, sleep_level=1, kv_cache_max_tokens=200_000)
    at = lambda total: plan_memory(inputs("1.5b", device=DeviceMemory(name="d", total=total, context=600 * MiB),  # noqa: E731
                                          device_fraction=1.0, **given))
    peak = at(200 * GiB).peak_bytes
    assert at(peak).fits and apply_plan(at(peak)).micro_batch_tokens == 32768
    with pytest.raises(ConfigError) as e:
        apply_plan(at(peak - 1))
    assert e.value.key == "train.micro_batch_tokens" and "lower train.micro_batch_tokens (32768)" in e.value.message


def test_nothing_fits_names_what_to_change():
    # a 7B full fine-tune on a 40 GiB device: even one sequence does not fit
    plan = plan_memory(inputs("7b", device=DeviceMemory(name="small", total=40 * GiB, context=0)))
    assert not plan.fits
    with pytest.raises(ConfigError) as e:
        apply_plan(plan)
    assert "train with LoRA" in e.value.message and "more GPUs" in e.value.message


def test_device_fraction_bounds_the_chosen_micro_batch():
    big = plan_memory(inputs("1.5b", device_fraction=0.9)).choice.micro_batch_tokens
    small = plan_memory(inputs("1.5b", device_fraction=0.6)).choice.micro_batch_tokens
    assert small < big
    assert plan_memory(inputs("1.5b", device_fraction=0.6)).peak_bytes <= 0.6 * H200.total


def test_kv_cache_follows_the_engines_own_sizing_rule():
    """One owner of the KV budget: the engine sizes its cache at each wake-up
    (``tidal.engine.sizing.kv_budget_bytes`` of the memory available then); the plan predicts that
    size with the same rule, from the steady state's resident memory, and never changes engine.*."""
    from tidal.engine import sizing
    from tidal.engine.config import EngineConfig

    on_device = plan_memory(inputs("3b", offload_optimizer=False, kv_cache_memory_fraction=0.7))
    offloaded = plan_memory(inputs("3b", offload_optimizer=True, kv_cache_memory_fraction=0.7))
    assert offloaded.kv_cache_tokens > on_device.kv_cache_tokens  # AdamW's state on the device leaves less at wake-up
    rollout = next(p for p in on_device.phases if p.name == "rollout")
    resident = sum(p.nbytes for p in rollout.parts if p.allocated and p.label in ("actor weights", "actor optimizer state"))
    engine_weights = next(p.nbytes for p in rollout.parts if p.label == "engine weights")
    overhead = next(p.nbytes for p in rollout.parts if p.label.startswith("CUDA context"))
    available = H200.total - overhead - resident - engine_weights
    per_token = qwen("3b").kv_cache_bytes_per_token()
    want = sizing.kv_budget_bytes(EngineConfig(kv_cache_memory_fraction=0.7), available) // (16 * per_token) * 16
    assert on_device.kv_cache_tokens == want
    assert any(p.label == f"engine KV cache ({want} tokens)" for p in rollout.parts)
    # an explicit cap is the cache's size; the plan chooses nothing for the engine
    assert plan_memory(inputs("3b", kv_cache_max_tokens=40000)).kv_cache_tokens == 40000
    assert [k for k in on_device.chosen() if k.startswith("engine.")] == ["engine.sleep_level"]  # what sleep frees, not the cache


def test_kv_cache_smaller_than_one_sequence_names_the_engine_setting():
    with pytest.raises(ConfigError) as e:
        apply_plan(plan_memory(inputs("0.5b", kv_cache_max_tokens=1024)))
    assert e.value.key == "engine.kv_cache_max_tokens" and "less than one sequence of 1280" in e.value.message
    # a cache that holds some but not all of the rollout's sequences: a note, the rollout runs in waves
    plan = plan_memory(inputs("0.5b", kv_cache_max_tokens=12800))
    assert plan.fits and any("holds 10 of the rollout's 256 sequences" in n for n in plan.notes)


# ---- host memory -------------------------------------------------------------------------------------------------
def test_host_budget_counts_every_rank_on_the_host():
    small_host = HostMemory(total=48 * GiB, source="test")
    with pytest.raises(ConfigError) as e:  # 57 GiB of pinned moments (given) do not fit 90% of 48 GiB
        apply_plan(plan_memory(inputs("7b", host=small_host, offload_optimizer=True)))
    assert e.value.key == "memory.host_memory_gib"
    # 0.5B with the engine asleep at level 2: pinned weights per rank, times the ranks on the host
    one = plan_memory(inputs("0.5b", sleep_level=2, world_size=1, local_world_size=1))
    four = plan_memory(inputs("0.5b", sleep_level=2, world_size=4, local_world_size=4))
    assert any(p.label.startswith("engine weights while asleep") for p in one.host_parts)
    assert four.host_bytes == 4 * sum(p.nbytes for p in four.host_parts)


def test_host_memory_detection(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:        1000 kB\n")
    v2 = tmp_path / "memory.max"
    assert meminfo_total(str(meminfo)) == 32000000 * 1024
    v2.write_text("max\n")
    assert cgroup_limit((str(v2),)) is None
    assert host_memory(meminfo=str(meminfo), cgroup_files=(str(v2),)) == (32000000 * 1024, "MemTotal")
    v2.write_text(f"{16 * GiB}\n")  # a cgroup limit is what the kernel enforces: it wins
    assert host_memory(meminfo=str(meminfo), cgroup_files=(str(v2),)) == (16 * GiB, "cgroup memory limit, MemTotal reads 30.5 GiB")
    v2.write_text(f"{256 * GiB}\n")  # also above a MemTotal that reads low (memory that grows as it is used)
    assert host_memory(meminfo=str(meminfo), cgroup_files=(str(v2),))[0] == 256 * GiB
    v1 = tmp_path / "memory.limit_in_bytes"
    v1.write_text(f"{2**63 - 4096}\n")  # cgroup v1's "no limit"
    assert host_memory(meminfo=str(meminfo), cgroup_files=(str(v1),)) == (32000000 * 1024, "MemTotal")
    assert host_memory(100.0, meminfo=str(meminfo), cgroup_files=(str(v2),)) == (100 * GiB, "memory.host_memory_gib")


# ---- config and the run's settings ------------------------------------------------------------------------------------
def test_auto_config_values_and_errors():
    cfg = load_config("quickstart")
    assert (cfg.train.micro_batch_tokens, cfg.train.forward_micro_batch_tokens) == ("auto", "auto")
    assert cfg.model.gradient_checkpointing == "auto" and cfg.strategy.offload_optimizer == "auto"
    cfg = load_config("quickstart", ["train.micro_batch_tokens=4096", "model.gradient_checkpointing=true",
                                     "strategy.offload_optimizer=false"])
    assert (cfg.train.micro_batch_tokens, cfg.model.gradient_checkpointing, cfg.strategy.offload_optimizer) == (4096, True, False)
    for override, key in [("train.micro_batch_tokens=0", "train.micro_batch_tokens"), ("train.micro_batch_tokens=big", "train.micro_batch_tokens"),
                          ("train.forward_micro_batch_tokens=-1", "train.forward_micro_batch_tokens"),
                          ("model.gradient_checkpointing=sometimes", "model.gradient_checkpointing"),
                          ("strategy.offload_optimizer=1", "strategy.offload_optimizer"),
                          ("memory.device_fraction=1.5", "memory.device_fraction"), ("memory.host_fraction=0", "memory.host_fraction"),
                          ("memory.device_memory_gib=-1", "memory.device_memory_gib"), ("memory.host_memory_gib=-2", "memory.host_memory_gib")]:
        with pytest.raises(ConfigError) as e:
            load_config("quickstart", [override])
        assert e.value.key == key, override


def test_resolved_sections_are_copies_with_the_run_values():
    cfg = load_config("quickstart", ["train.micro_batch_tokens=4096"])
    settings = apply_plan(plan_memory(inputs("7b")))
    train, model, strategy = settings.train_config(cfg.train), settings.model_config(cfg.model), settings.strategy_config(cfg.strategy)
    assert (train.micro_batch_tokens, train.forward_micro_batch_tokens) == (settings.micro_batch_tokens, settings.forward_micro_batch_tokens)
    assert model.gradient_checkpointing is True and strategy.offload_optimizer is True
    # the user's objects keep what the user wrote
    assert cfg.train.micro_batch_tokens == 4096 and cfg.model.gradient_checkpointing == "auto" and cfg.strategy.offload_optimizer == "auto"


QWEN_05B_HF = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)


def _plan_run(cfg, hf=None, **kw):
    return plan_run(cfg, hf or Qwen2Config(**QWEN_05B_HF), device=torch.device("cpu"), world_size=1, is_main=True,
                    needs_reference=False, needs_critic=False, **kw)


def test_cpu_runs_without_a_device_size_make_no_plan_and_keep_explicit_values():
    auto = settings_without_plan(load_config("quickstart"))
    assert (auto.micro_batch_tokens, auto.forward_micro_batch_tokens, auto.gradient_checkpointing, auto.offload_optimizer) == \
        (16384, 65536, False, False) and auto.plan is None
    given = settings_without_plan(load_config("quickstart", ["train.micro_batch_tokens=512", "strategy.offload_optimizer=true"]))
    assert (given.micro_batch_tokens, given.offload_optimizer) == (512, True)
    assert _plan_run(load_config("quickstart")).plan is None
    # a packed micro-batch holds whole sequences: without a plan `auto` is at least the longest one
    long = load_config("quickstart", ["data.max_prompt_len=8192", "rollout.max_new_tokens=70000"])
    unplanned = _plan_run(long)
    assert (unplanned.micro_batch_tokens, unplanned.forward_micro_batch_tokens) == (78192, 78192)
    # an explicit budget below the longest sequence is the run's check before loading (after the model's
    # positions: tidal.build.check_context_budget); auto is the plan's to resolve
    with pytest.raises(ConfigError) as e:
        check_context_budget(load_config("quickstart", ["data.max_prompt_len=8192", "rollout.max_new_tokens=70000",
                                                        "train.micro_batch_tokens=16384"]), None)
    assert e.value.key == "train.micro_batch_tokens"
    # memory.* that no plan would read: an error naming the key, not a silent ignore
    for override, key in [("memory.device_fraction=0.8", "memory.device_fraction"), ("memory.host_memory_gib=64", "memory.host_memory_gib")]:
        with pytest.raises(ConfigError) as e:
            _plan_run(load_config("quickstart", [override]))
        assert e.value.key == key and "memory.device_memory_gib" in e.value.message


def test_a_given_device_size_plans_also_on_cpu(capsys):
    """memory.device_memory_gib: the plan is made for that device (counted as CUDA: compiled,
    the KV cache outside the allocator), printed and applied."""
    cfg = load_config("quickstart", ["memory.device_memory_gib=80", "memory.host_memory_gib=64", "rollout.max_new_tokens=512"])
    settings = _plan_run(cfg)
    plan = settings.plan
    assert plan is not None and plan.inputs.compiled and plan.inputs.kv_outside_allocator
    assert settings.micro_batch_tokens == plan.choice.micro_batch_tokens and settings.gradient_checkpointing is False
    assert "memory plan: 80 GiB device (memory.device_memory_gib)" in capsys.readouterr().out
    # too small a device: the run stops here with the key to change
    with pytest.raises(ConfigError) as e:
        _plan_run(load_config("quickstart", ["memory.device_memory_gib=8", "memory.host_memory_gib=64", "train.micro_batch_tokens=65536"]))
    assert e.value.key == "train.micro_batch_tokens"


def test_run_config_resolves_every_planned_section():
    cfg = load_config("quickstart")
    settings = apply_plan(plan_memory(inputs("3b", sequences_per_rank=512)))
    run = settings.run_config(cfg)
    assert (run.train.micro_batch_tokens, run.train.forward_micro_batch_tokens) == (settings.micro_batch_tokens,
                                                                                    settings.forward_micro_batch_tokens)
    assert run.model.gradient_checkpointing is settings.gradient_checkpointing
    assert run.strategy.offload_optimizer is settings.offload_optimizer
    # the engine sizes its KV cache itself (the plan only predicts it); the plan chooses what its sleep frees
    assert run.engine == dataclasses.replace(cfg.engine, sleep_level=settings.sleep_level) and cfg.engine.sleep_level == "auto"
    assert run.rollout is cfg.rollout and cfg.train.micro_batch_tokens == "auto"  # the rest shared, the user's config as written


def test_make_plan_reads_the_memory_section():
    cfg = load_config("quickstart", ["memory.device_memory_gib=80", "memory.host_memory_gib=64", "memory.device_fraction=0.8",
                                     "rollout.max_new_tokens=512", "train.micro_batch_tokens=4096"])
    hf = Qwen2Config(**QWEN_05B_HF)
    plan = make_plan(cfg, hf, device=torch.device("cpu"), world_size=1, needs_reference=True, needs_critic=False)
    inp = plan.inputs
    assert inp.device.total == 80 * GiB and inp.budget == int(0.8 * 80 * GiB)
    assert (inp.host.total, inp.host.source) == (64 * GiB, "memory.host_memory_gib")
    assert inp.micro_batch_tokens == 4096 and inp.gradient_checkpointing is None and inp.rollout.max_new_tokens == 512
    # the run's own sections: the plan reads their values (defaults included), it keeps no copy of them
    assert inp.train is cfg.train and inp.engine is cfg.engine and inp.strategy is cfg.strategy and inp.memory is cfg.memory
    assert plan.fits and plan.choice.micro_batch_tokens == 4096
    assert any(p.label.startswith("parked reference") for p in plan.host_parts)  # KL on, reference parked on the host
    text = plan.table()
    assert "train.micro_batch_tokens=4096," in text and "model.gradient_checkpointing=false (auto)" in text
    with pytest.raises(ConfigError) as e:  # no device to read: the key to set is named
        make_plan(load_config("quickstart"), hf, device=torch.device("cpu"), world_size=1, needs_reference=False, needs_critic=False)
    assert e.value.key == "memory.device_memory_gib"


def _agree_worker(rank: int, path: str, out: str):
    import torch.distributed as dist

    from tidal.memory.probe import agreed

    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    try:
        def all_reduce_max(values):  # as Runtime.all_reduce_max
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()

        dev, host = agreed(DeviceMemory(name="d", total=(80 + rank) * GiB, context=(1 + rank) * MiB),
                           HostMemory(total=(100 - rank) * GiB, source="s"), all_reduce_max)
        with open(f"{out}.{rank}", "w") as f:
            f.write(f"{dev.total} {dev.context} {host.total}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_the_machine(tmp_path):
    """Every rank plans with the smallest device and host and the largest CUDA context."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "agreed")
    mp.start_processes(_agree_worker, args=(str(tmp_path / "store"), out), nprocs=2, start_method="spawn")
    results = {open(f"{out}.{r}").read() for r in range(2)}
    assert results == {f"{80 * GiB} {2 * MiB} {99 * GiB}"}


@pytest.mark.parametrize("level", [0, 1, 2])
def test_engine_sleep_level_decides_what_stays_during_training(level):
    plan = plan_memory(inputs("1.5b", sleep_level=level))
    update = {p.label.split(" (")[0] for p in next(ph for ph in plan.phases if ph.name == "update").parts}
    assert ("engine weights" in update) == (level < 2)
    assert ("engine KV cache" in update) == (level == 0)
    assert ("CUDA graph pool" in update) == (level < 2)  # graphs survive level-1 sleeps (fixed-address KV)
    host = {p.label for p in plan.host_parts}
    assert ("engine weights while asleep (pinned)" in host) == (level == 2)


def test_experience_counts_the_largest_forward_with_its_reloaded_weights():
    """A 7B distillation teacher of a 1.5B student: the experience peak is the teacher's forward with
    its bf16 weights brought in (parked on the host otherwise)."""
    plain = next(p for p in plan_memory(inputs("1.5b")).phases if p.name == "experience")
    plan = plan_memory(inputs("1.5b", teacher=qwen("7b")))
    exp = next(p for p in plan.phases if p.name == "experience")
    parts = {p.label: p.nbytes for p in exp.parts}
    assert parts["teacher weights (reloaded)"] == 2 * qwen("7b").params()
    assert "teacher forward (65536 tokens)" in parts and exp.total > plain.total
    assert any(p.label == "parked teacher weights (pinned)" for p in plan.host_parts)
    resident = plan_memory(inputs("1.5b", teacher=qwen("7b"), offload_teacher=False))
    update = {p.label for p in next(p for p in resident.phases if p.name == "update").parts}
    assert "teacher weights" in update  # kept on the device when not offloaded


def test_make_plan_counts_a_local_teacher(tmp_path):
    """model.teacher.path: its shape comes from its own config (here a 7B teacher of a 0.5B
    student), parked per strategy.offload_teacher."""
    hf = Qwen2Config(**QWEN_05B_HF)
    teacher = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                          intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
    kw = dict(device=torch.device("cpu"), world_size=1, needs_reference=False, needs_critic=False)
    overrides = ["memory.device_memory_gib=140", "memory.host_memory_gib=256", f"model.teacher.path={tmp_path}",
                 "algorithm.distill_coef=1.0"]
    plan = make_plan(load_config("quickstart", overrides), hf, teacher_hf_config=teacher, **kw)
    assert plan.inputs.teacher == ModelShape.from_hf_config(teacher) and plan.inputs.strategy.offload_teacher
    assert any(p.label == "parked teacher weights (pinned)" for p in plan.host_parts)
    resident = make_plan(load_config("quickstart", overrides + ["strategy.offload_teacher=false"]), hf, teacher_hf_config=teacher, **kw)
    assert "teacher weights" in {p.label for p in next(p for p in resident.phases if p.name == "update").parts}
    assert make_plan(load_config("quickstart", ["memory.device_memory_gib=140"]), hf, **kw).inputs.teacher is None


def test_components_refuse_auto_where_the_plan_decides():
    """Every reader of a planned setting takes the resolved value: a Strategy built without a plan
    keeps the optimizer state on the device (``auto`` -> off); the updater and the experience maker
    refuse an unresolved token budget instead of guessing."""
    from tidal.distributed.runtime import init_runtime, shutdown
    from tidal.strategy import StrategyConfig, get_strategy
    from tidal.trainer.config import TrainConfig, require_resolved

    runtime = init_runtime(1, "cpu")
    try:
        assert get_strategy(StrategyConfig(compile="off"), runtime).cfg.offload_optimizer is False
        assert get_strategy(StrategyConfig(compile="off", offload_optimizer=True), runtime).cfg.offload_optimizer is True
    finally:
        shutdown()
    with pytest.raises(ValueError, match="train.micro_batch_tokens is 'auto'"):
        require_resolved(TrainConfig(), "train", "micro_batch_tokens")
    require_resolved(TrainConfig(micro_batch_tokens=4096), "train", "micro_batch_tokens")
