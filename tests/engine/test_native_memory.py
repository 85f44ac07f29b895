"""sleep / wake_up / load_weights / memory_report of the native engine (CPU)."""

import pytest
import torch

from tidal.engine.base import RolloutEngine, SamplingParams

from .helpers import PROMPTS, engine_for, hf_greedy, tiny_hf

GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


def test_engine_implements_the_protocol_and_allocates_kv_lazily():
    engine = engine_for(tiny_hf("qwen2"), kv_cache_max_tokens=64, block_size=8)
    assert isinstance(engine, RolloutEngine)
    report = engine.memory_report()
    assert report["kv_cache"] == 0
    # 2 layers x (K, V) x (8 blocks + 1 scratch) x 8 tokens x 2 KV heads x 16 dims x 4 bytes
    kv_bytes = 2 * 2 * 9 * 8 * 2 * 16 * 4
    assert engine.wake_up() == kv_bytes
    assert engine.memory_report()["kv_cache"] == kv_bytes
    assert report["weights"] == sum(p.numel() * 4 for p in engine.model.parameters())


def test_sleep_frees_kv_and_wake_restores_same_outputs():
    hf = tiny_hf("qwen2")
    engine = engine_for(hf, kv_cache_max_tokens=128)
    before = engine.generate(PROMPTS, GREEDY)
    kv_bytes = engine.memory_report()["kv_cache"]
    assert kv_bytes > 0
    assert engine.sleep(1) == kv_bytes
    assert engine.memory_report()["kv_cache"] == 0
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(PROMPTS, GREEDY)
    assert engine.wake_up() == kv_bytes
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in before]
    # level 2 on a CPU engine: weights are already in host memory, only the KV cache is freed
    assert engine.sleep(2) == kv_bytes
    engine.wake_up()
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in before]


def test_load_weights_in_place_changes_outputs_and_forgets_prefix_cache():
    hf_a, hf_b = tiny_hf("qwen3", seed=0), tiny_hf("qwen3", seed=1)
    engine = engine_for(hf_a)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    prompt = list(range(30, 47))
    (a,) = engine.generate([prompt], GREEDY)
    assert a.token_ids == hf_greedy(hf_a, prompt, 6)
    engine.load_weights(hf_b.state_dict().items())
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs  # copied in place
    hits = engine.stats["prefix_hit_tokens"]
    (b,) = engine.generate([prompt], GREEDY)
    assert engine.stats["prefix_hit_tokens"] == hits  # the old weights' KV was not reused
    assert b.token_ids == hf_greedy(hf_b, prompt, 6) != a.token_ids


def test_same_prompt_again_hits_the_prefix_cache_with_unchanged_weights():
    engine = engine_for(tiny_hf("qwen2"), block_size=4)
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks before the last token
    (a,) = engine.generate([prompt], GREEDY)
    (b,) = engine.generate([prompt], GREEDY)
    assert engine.stats["prefix_hit_tokens"] == 12 and a.token_ids == b.token_ids


class _FakeFixedMemory:
    """Stands in for the CUDA-only FixedAddressMemory: one host buffer whose bytes are scrambled on
    unmap (the physical memory is gone; a new map's contents are undefined)."""

    instances = []

    def __init__(self, nbytes, device):
        self.nbytes, self.buf, self.mapped, self.maps = nbytes, torch.empty(nbytes, dtype=torch.uint8), False, 0
        _FakeFixedMemory.instances.append(self)

    def map(self):
        assert not self.mapped
        self.mapped, self.maps = True, self.maps + 1
        return self.buf

    def unmap(self):
        self.mapped = False
        self.buf.fill_(0xFF)  # NaN in every float format

    def close(self):
        self.mapped = False


def test_fixed_address_kv_cache_is_sized_once_and_remapped_on_wake(monkeypatch):
    """Where the driver offers fixed-address memory, sleep unmaps the KV cache and wake maps the same
    range again at the first allocation's size (even when the memory-derived size would differ), zeroed."""
    from tidal.engine.native import fixed_memory

    monkeypatch.setattr(fixed_memory, "supported", lambda device: True)
    monkeypatch.setattr(fixed_memory, "FixedAddressMemory", _FakeFixedMemory)
    _FakeFixedMemory.instances.clear()
    hf = tiny_hf("qwen2")
    engine = engine_for(hf, kv_cache_max_tokens=128)
    before = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert before == [hf_greedy(hf, p, 6) for p in PROMPTS]
    (mem,) = _FakeFixedMemory.instances
    ptr, kv_bytes = engine.runner.kv_cache.data_ptr(), engine.memory_report()["kv_cache"]
    assert mem.nbytes == kv_bytes and mem.buf.data_ptr() == ptr
    engine.cfg.kv_cache_max_tokens = 64  # what a fresh sizing would now give: ignored, the range stays
    for level in (1, 2):
        assert engine.sleep(level) == kv_bytes and not mem.mapped
        assert engine.wake_up() == kv_bytes and mem.mapped
        assert not engine.runner.kv_cache.any()  # zeroed like a fresh cache
        assert engine.runner.kv_cache.data_ptr() == ptr and len(_FakeFixedMemory.instances) == 1
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == before
    assert mem.maps == 3
