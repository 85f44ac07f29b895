"""``auto`` picks what fits (issue 50 item 6): the memory plan chooses, for every setting left at
``auto`` (``engine.sleep_level``, ``strategy.offload_optimizer``, ``model.gradient_checkpointing``,
the token budgets), the cheapest combination that fits, keeps every value given, and when nothing
fits says so before loading with the smallest combination; memory other processes hold is named."""

import dataclasses

import pytest
import torch

from tidal.config_base import ConfigError
from tidal.engine.config import EngineConfig
from tidal.memory.plan import (
    GiB,
    MIN_EFFICIENT_MICRO_BATCH_TOKENS,
    MiB,
    DeviceMemory,
    ModelShape,
    _candidates,
    _transfer_bytes,
    apply_plan,
    plan_memory,
    settings_without_plan,
)
from tidal.memory.probe import ASSUMED_CUDA_CONTEXT, OTHERS_MIN_BYTES, other_processes_bytes
from tests.unit.test_memory_plan import ALL_TARGETS, inputs, qwen

# one H100 80GB as torch.cuda.mem_get_info reads it, a fresh process's CUDA context
H100 = DeviceMemory(name="H100 80GB", total=int(79.2 * GiB), context=600 * MiB)
# Llama-3-70B's config.json
LLAMA_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256,
                       tied_embeddings=False, model_type="llama")


def on_h100(size: str, **kw):
    """The issue's GRPO shape (256 sequences x (256 prompt + 1024 new)) on one H100, from the defaults."""
    return plan_memory(inputs(size, device=H100, **kw))


def phase(plan, name):
    return next(p for p in plan.phases if p.name == name)


def test_7b_full_fine_tune_fits_one_h100_from_the_defaults():
    plan = on_h100("7b")
    assert plan.fits, plan.table()
    c = plan.choice
    # the engine's weights wait on the host, AdamW's state streams from the host, layers are recomputed
    assert (c.sleep_level, c.offload_optimizer, c.gradient_checkpointing) == (2, True, True)
    assert c.micro_batch_tokens >= MIN_EFFICIENT_MICRO_BATCH_TOKENS and plan.peak_bytes <= 0.9 * H100.total
    assert "engine weights" not in {p.label for p in phase(plan, "update").parts}
    assert any(p.label == "engine weights while asleep (pinned)" for p in plan.host_parts)
    assert plan.chosen()["engine.sleep_level"] == 2
    line = next(ln for ln in plan.table().splitlines() if ln.strip().startswith("settings:"))
    assert "engine.sleep_level=2 (auto)" in line and "strategy.offload_optimizer=true (auto)" in line
    # the cheapest that fits: every candidate before it in cost order misses the budget
    settings = apply_plan(plan)
    assert (settings.sleep_level, settings.offload_optimizer, settings.gradient_checkpointing) == (2, True, True)
    for offload, gc, level in _candidates(plan.inputs):
        if (offload, gc, level) == (True, True, 2):
            break
        assert not on_h100("7b", offload_optimizer=offload, gradient_checkpointing=gc, sleep_level=level).fits or \
            on_h100("7b", offload_optimizer=offload, gradient_checkpointing=gc, sleep_level=level).choice.micro_batch_tokens \
            < MIN_EFFICIENT_MICRO_BATCH_TOKENS


def test_values_given_are_kept_never_rewritten():
    # engine.sleep_level=1 given: the same run cannot fit, and the error names it rather than change it
    with pytest.raises(ConfigError) as e:
        apply_plan(on_h100("7b", sleep_level=1))
    assert e.value.key == "engine.sleep_level" and "set engine.sleep_level=2" in e.value.message
    # a level given is the plan's level, and not among its choices
    plan = on_h100("0.5b", sleep_level=0)
    assert plan.choice.sleep_level == 0 and "engine.sleep_level" not in plan.chosen()
    assert "engine.sleep_level=0," in plan.table() and "engine.sleep_level=0 (auto)" not in plan.table()
    assert any(p.label.startswith("engine KV cache") for p in phase(plan, "update").parts)  # level 0 keeps the cache
    assert apply_plan(plan).sleep_level == 0
    # checkpointing given off: the rest is chosen around it (the smallest, as nothing fits), never turned on
    plan = on_h100("7b", gradient_checkpointing=False)
    assert not plan.fits and plan.tried == 4
    assert (plan.choice.gradient_checkpointing, plan.choice.offload_optimizer, plan.choice.sleep_level) == (False, True, 2)
    with pytest.raises(ConfigError) as e:
        apply_plan(plan)
    assert "set model.gradient_checkpointing=true (or auto)" in e.value.message


def test_half_a_billion_keeps_everything_on_the_device():
    plan = on_h100("0.5b")
    c = plan.choice
    assert plan.fits and (c.sleep_level, c.offload_optimizer, c.gradient_checkpointing) == (1, False, False)
    assert c.micro_batch_tokens >= MIN_EFFICIENT_MICRO_BATCH_TOKENS
    assert [p.label for p in plan.host_parts] == ["process (Python, torch, CUDA libraries)"]  # nothing parked


def test_70b_on_one_card_is_refused_with_the_smallest_combination():
    inp = dataclasses.replace(inputs("7b", device=H100), shape=LLAMA_70B)
    plan = plan_memory(inp)
    assert not plan.fits and plan.tried == 8  # 2 sleep levels x offload x checkpointing
    c = plan.choice  # the smallest: everything that frees memory, one longest sequence per micro-batch
    assert (c.sleep_level, c.offload_optimizer, c.gradient_checkpointing, c.micro_batch_tokens) == (2, True, True, 1280)
    with pytest.raises(ConfigError) as e:
        apply_plan(plan)
    msg = e.value.message
    assert msg.startswith("the run does not fit in memory: none of the 8 combination(s) of the settings left at auto fits")
    assert "the smallest (train.micro_batch_tokens=1280, train.forward_micro_batch_tokens=" in msg
    assert "engine.sleep_level=2) is shown below" in msg
    # why: the fp32 weights alone (4 bytes x 70.6B) are over the card; the table shows each phase's peak
    weights = next(p.nbytes for p in phase(plan, "update").parts if p.label == "actor weights")
    assert weights == 4 * LLAMA_70B.params() > H100.total
    assert "OVER BUDGET" in msg and "use more GPUs" in msg and "update  " in msg
    assert "set engine.sleep_level" not in msg and "set strategy.offload_optimizer" not in msg  # tried already


def test_cost_order_moves_the_fewest_bytes_first():
    """Within the same checkpointing, the choice that moves fewer bytes between host and device per
    step comes first: level-2 sleep moves the bf16 engine weights out and back (4 bytes a
    parameter), optimizer offload both fp32 moments in and out at every optimizer step (16)."""
    full = inputs("7b", device=H100)
    n = qwen("7b").params()
    assert _transfer_bytes(full, False, 2) == 2 * 2 * n
    assert _transfer_bytes(full, True, 1) == 2 * 8 * n
    assert _candidates(full) == [(False, False, 1), (False, False, 2), (True, False, 1), (True, False, 2),
                                 (False, True, 1), (False, True, 2), (True, True, 1), (True, True, 2)]
    # two optimizer steps per step: twice the offload's traffic
    assert _transfer_bytes(dataclasses.replace(full, train=dataclasses.replace(full.train, mini_batches=2)), True, 1) == 2 * 2 * 8 * n
    # LoRA: a few MB of adapter state move less than the base's weights: offload before sleep
    lora = inputs("7b", device=H100, lora_rank=16, lora_targets=ALL_TARGETS)
    assert _candidates(lora)[:3] == [(False, False, 1), (True, False, 1), (False, False, 2)]
    # values given: only they
    assert _candidates(inputs("7b", device=H100, sleep_level=1, offload_optimizer=True)) == [(True, False, 1), (True, True, 1)]


def test_without_a_plan_auto_sleeps_at_level_one():
    from tidal.config import load_config

    assert EngineConfig().sleep_level == "auto"
    assert settings_without_plan(load_config("quickstart")).sleep_level == 1
    assert settings_without_plan(load_config("quickstart", ["engine.sleep_level=2"])).sleep_level == 2
    with pytest.raises(ConfigError) as e:
        EngineConfig(sleep_level=3)
    assert e.value.key == "sleep_level" and "auto" in e.value.message


def test_an_engine_built_on_its_own_sleeps_as_a_run_without_a_plan():
    """A run hands the engine its plan's level; an engine built directly (a script) takes level 1."""
    from transformers import Qwen2Config

    from tidal.engine.factory import create_engine
    from tidal.memory.plan import UNPLANNED_DEFAULTS

    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=64)
    engine = create_engine(cfg, EngineConfig(backend="hf"), device=torch.device("cpu"), dtype=torch.float32)
    assert engine.cfg.sleep_level == UNPLANNED_DEFAULTS["sleep_level"] == 1


# ---- memory other processes hold ---------------------------------------------------------------------------
def test_other_processes_are_named_for_what_they_hold():
    # the case: 24 GB held by an earlier crashed process
    held = DeviceMemory(name="H100 80GB", total=int(79.2 * GiB), context=600 * MiB, others=24 * GiB,
                        others_source="1 process(es) by nvidia-smi: pid 4242")
    plan = plan_memory(inputs("7b", device=held))
    assert not plan.fits
    update = {p.label: p for p in phase(plan, "update").parts}
    assert update["held by other processes"].nbytes == 24 * GiB and not update["held by other processes"].allocated
    assert update["CUDA context and library reserve"].nbytes < 2 * GiB  # this process's own, not the others'
    assert any("24.0 GiB of this device are held by other processes (1 process(es) by nvidia-smi: pid 4242)" in n for n in plan.notes)
    with pytest.raises(ConfigError) as e:
        apply_plan(plan)
    assert "24.0 GiB of the device are held by other processes (1 process(es) by nvidia-smi: pid 4242): end them" in \
        e.value.message.splitlines()[0]
    # they leave less for the KV cache at wake-up, byte for byte
    free = plan_memory(inputs("7b", device=H100, kv_cache_max_tokens=0))
    assert plan.kv_cache_tokens < free.kv_cache_tokens


def test_other_processes_measured_by_pid_or_beyond_this_context():
    outside = 25 * GiB  # in use on the device beyond this process's allocator
    # NVML lists this process (pid 10) and another (pid 11): the other's bytes are the others'
    assert other_processes_bytes(outside, {10: GiB, 11: 24 * GiB}, pid=10) == (24 * GiB, "1 process(es) by nvidia-smi: pid 11")
    assert other_processes_bytes(outside, {10: GiB}, pid=10) == (0, "")
    # no per-process figures: what is beyond an assumed CUDA context, when it is at least 1 GiB
    held, source = other_processes_bytes(outside, None, pid=10)
    assert held == outside - ASSUMED_CUDA_CONTEXT and "torch.cuda.mem_get_info" in source
    assert other_processes_bytes(ASSUMED_CUDA_CONTEXT + OTHERS_MIN_BYTES - 1, None, pid=10) == (0, "")
    # a container: NVML's host pids are not ours
    held, source = other_processes_bytes(outside, {777: 24 * GiB}, pid=10)
    assert held == outside - ASSUMED_CUDA_CONTEXT and "pid 777" in source


def test_nvidia_smi_processes_of_this_device_only(monkeypatch):
    import subprocess
    import types

    from tidal.memory import probe

    out = ("GPU-aaaa, 4242, 24576\n"  # the crashed process, on this device
           "GPU-aaaa, 100, 900\n"
           "GPU-bbbb, 555, 8000\n"  # another device
           "GPU-aaaa, 7, [N/A]\n")  # no figure: skipped
    monkeypatch.setattr(probe.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(probe.subprocess, "run", lambda *a, **kw: types.SimpleNamespace(stdout=out))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="aaaa"))
    per_pid = probe._processes_on(torch.device("cuda", 0))
    assert per_pid == {4242: 24576 * MiB, 100: 900 * MiB}
    assert other_processes_bytes(26 * GiB, per_pid, pid=100) == (24 * GiB, "1 process(es) by nvidia-smi: pid 4242")

    def fails(*a, **kw):
        raise subprocess.CalledProcessError(9, "nvidia-smi")

    monkeypatch.setattr(probe.subprocess, "run", fails)
    assert probe._processes_on(torch.device("cuda", 0)) is None
    monkeypatch.setattr(probe.shutil, "which", lambda name: None)
    assert probe._processes_on(torch.device("cuda", 0)) is None


def test_a_run_that_cannot_fit_shows_its_plan_once_in_one_error(capsys):
    from tidal.config import load_config
    from tests.unit.test_memory_plan import _plan_run

    with pytest.raises(ConfigError) as e:  # 0.5B's fp32 weights and gradients alone are more than 4 GiB
        _plan_run(load_config("quickstart", ["memory.device_memory_gib=4", "memory.host_memory_gib=64"]))
    assert capsys.readouterr().out == ""  # not printed beside the error
    msg = e.value.message
    assert msg.count("memory plan: 4 GiB device") == 1 and "engine.sleep_level=2 (auto)" in msg
