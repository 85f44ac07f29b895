"""The step's memory by component (issue 23 item 12): a trained model's weights and optimizer state
on the device counted from the storages behind them (local shards, each storage once, only the
device's), by hand on tiny models; the update's activation peak and the memory metrics on CUDA."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.logging.console import memory_text
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy
from tidal.strategy.resident import device_bytes
from tidal.logging.memory_parts import MemoryParts
from tidal.logging.memory_peaks import DevicePeaks
from tidal.logging.timer import PhaseTimer

CPU = torch.device("cpu")


def test_device_bytes_counts_each_storage_once_and_only_the_devices():
    w = torch.zeros(4, 3)  # 48 bytes
    b = torch.zeros(3, dtype=torch.bfloat16)  # 6 bytes
    assert device_bytes([w, b], CPU) == 54
    assert device_bytes([w, w[1:], w.view(-1), b], CPU) == 54  # views and repeats: one storage each
    flat = torch.zeros(10)  # a flat buffer's partitions count as the whole buffer (it is what is held)
    assert device_bytes([flat[:3], flat[3:]], CPU) == 40
    assert device_bytes([w, b], torch.device("cuda")) == 0  # offloaded to the host: not on the device
    assert device_bytes([torch.zeros(0)], CPU) == 0


@pytest.fixture
def runtime():
    rt = init_runtime(1, "cpu")
    yield rt
    shutdown()


def _tiny():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, vocab_size=50, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).float()


def test_fsdp2_resident_bytes_by_hand(runtime):
    model = _tiny()
    params = list(model.parameters())  # the tied embedding once
    numel = sum(p.numel() for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary inv_freq
    strategy = get_strategy(StrategyConfig(param_dtype="float32", compile=False), runtime)
    state = strategy.prepare_trainable(model, OptimConfig(lr=1e-3), lr=1e-3, total_steps=2)
    assert all(type(p).__name__ == "DTensor" for p in state.model.parameters())  # FSDP2 shards: counted locally
    assert strategy.resident_bytes(state) == {"weights": 4 * numel + buffers, "optimizer": 0}  # no step yet: no moments
    out = state.model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum()
    strategy.backward(out, state, sync_grads=True)
    strategy.optimizer_step(state)
    # AdamW: exp_avg and exp_avg_sq in fp32 per parameter element, and a float32 step per parameter
    assert strategy.resident_bytes(state) == {"weights": 4 * numel + buffers, "optimizer": 8 * numel + 4 * len(params)}
    strategy.offload_optimizer(state)  # on the CPU the "device" is the host: still there
    assert strategy.resident_bytes(state)["optimizer"] == 8 * numel + 4 * len(params)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_resident_bytes_by_hand(stage, runtime):
    pytest.importorskip("deepspeed")
    model = _tiny()
    numel = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    strategy = get_strategy(StrategyConfig(backend="deepspeed", zero_stage=stage, param_dtype="float32"), runtime)
    state = strategy.prepare_trainable(model, OptimConfig(lr=1e-3), lr=1e-3, total_steps=2)
    # weights: the compute-dtype parameters (ZeRO-3: this rank's partitions); optimizer: the fp32 masters
    assert strategy.resident_bytes(state) == {"weights": 4 * numel + buffers, "optimizer": 4 * numel}
    out = state.model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum()
    strategy.backward(out, state, sync_grads=True)
    strategy.optimizer_step(state)
    groups = len(state.model.basic_optimizer.param_groups)  # one flat fp32 partition per group, one step each
    assert strategy.resident_bytes(state) == {"weights": 4 * numel + buffers, "optimizer": 12 * numel + 4 * groups}


def test_memory_parts_record_an_update_and_are_cuda_metrics_only():
    parts = MemoryParts(DevicePeaks(CPU), lambda state: {"weights": 3 * 2**30, "optimizer": 6 * 2**30})
    with parts.update("actor", None):
        pass
    assert parts.bytes == {"actor_weights": 3 * 2**30, "actor_optimizer": 6 * 2**30}
    with pytest.raises(RuntimeError):  # an update that raises records nothing
        with parts.update("critic", None):
            raise RuntimeError
    assert "critic_weights" not in parts.bytes
    assert parts.pop({"kv_cache": 1}) == {} and parts.bytes == {}


def test_the_step_line_shows_every_part():
    m = {"memory/device_used_gib": 115.2, "memory/peak_allocated_gib": 40.06, "memory/actor_weights_gib": 1.84,
         "memory/critic_weights_gib": 1.0, "memory/actor_optimizer_gib": 3.68, "memory/actor_activations_peak_gib": 12.0,
         "memory/critic_activations_peak_gib": 9.0, "memory/engine_weights_gib": 0.93, "memory/engine_kv_cache_gib": 70.3,
         "memory/engine_graphs_gib": 0.4}
    assert memory_text(m) == ("mem 115.2 GiB on the device (peak alloc 40.1, weights 2.8, optimizer 3.7, activations peak 12.0, "
                              "engine weights 0.9, KV cache 70.3, graphs 0.4)")  # trained models' weights summed, peaks the largest


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA allocator statistics")
def test_cuda_update_peak_and_metrics():
    device = torch.device("cuda", torch.cuda.current_device())
    weights = torch.zeros(2**20, device=device)  # 4 MiB resident before the update
    parts = MemoryParts(DevicePeaks(device), lambda state: {"weights": device_bytes([weights], device), "optimizer": 0})
    big = torch.zeros(2**28, dtype=torch.uint8, device=device)  # a 256 MiB peak before the update...
    del big
    with parts.update("actor", None):
        act = torch.zeros(2**26, device=device)  # ...and a 256 MiB activation inside it
        del act
    assert parts.bytes["actor_activations_peak"] == 2**28
    assert parts.bytes["actor_weights"] == 4 * 2**20
    metrics = parts.pop({"kv_cache": 2**30})
    assert metrics["memory/actor_activations_peak_gib"] == 0.25 and metrics["memory/engine_kv_cache_gib"] == 1.0
    assert metrics["memory/peak_allocated_gib"] >= 0.25 + 4 / 1024  # the peak before the update is kept
    assert metrics["memory/device_used_gib"] >= metrics["memory/reserved_gib"] > 0


def test_peaks_off_cuda_read_none_and_scopes_still_close():
    peaks = DevicePeaks(CPU)
    timer = PhaseTimer(sync=lambda: None)
    timer.add_observer(peaks)
    with timer.phase("train"), peaks.scope("actor_update") as scope:
        pass
    assert scope.above_start == 0 and peaks._open == []
    phases, step = peaks.pop()
    assert set(phases) == {"train", "actor_update"} and step is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA allocator statistics")
def test_one_owner_gives_each_phase_its_own_peak_and_nested_phases_the_whole_peak():
    """The counter is reset only by DevicePeaks: a nested phase's boundary does not cut the outer
    phase's peak short, and a phase after a larger one does not see that one's peak."""
    device = torch.device("cuda", torch.cuda.current_device())
    peaks = DevicePeaks(device)
    timer = PhaseTimer()
    timer.add_observer(peaks)
    seen = {}
    with timer.phase("train"):
        big = torch.zeros(2**28, dtype=torch.uint8, device=device)  # 256 MiB inside "train", before the scope
        del big
        with peaks.scope("actor_update") as scope:
            small = torch.zeros(2**24, dtype=torch.uint8, device=device)  # 16 MiB inside the scope
            del small
        seen["scope"] = scope.above_start
    with timer.phase("weight_sync"):
        pass
    phases, step = peaks.pop()
    assert seen["scope"] == 2**24
    assert phases["train"].above_start >= 2**28  # the scope inside did not reset the outer peak away
    assert phases["weight_sync"].above_start < 2**24  # the earlier phases' peaks are not this one's
    assert step.allocated >= phases["train"].allocated
