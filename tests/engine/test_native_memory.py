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


class _FakeRegions:
    """Stands in for the CUDA-only FixedAddressRegions: one host buffer per region, of which a map
    hands out a prefix; an unmap scrambles the bytes (the physical memory is gone; a new map's
    contents are undefined)."""

    instances = []

    def __init__(self, num_regions, region_bytes, device):
        self.granularity = 256
        self.num_regions, self.region_bytes = num_regions, region_bytes // 256 * 256
        self.bufs = [torch.empty(self.region_bytes, dtype=torch.uint8) for _ in range(num_regions)]
        self.mapped_bytes, self.maps = 0, 0
        _FakeRegions.instances.append(self)

    @property
    def mapped(self):
        return self.mapped_bytes > 0

    def map(self, nbytes):
        assert not self.mapped and nbytes <= self.region_bytes
        self.mapped_bytes, self.maps = -(-nbytes // 256) * 256, self.maps + 1
        return [b[:nbytes] for b in self.bufs]

    def unmap(self):
        self.mapped_bytes = 0
        for b in self.bufs:
            b.fill_(0xFF)  # NaN in every float format


def _memory_sized(monkeypatch, available: list[int], fixed: bool):
    """Make a CPU engine size its KV cache like a CUDA one, from ``available`` bytes (one value per
    allocation), with fake fixed-address regions when ``fixed``."""
    from tidal.engine import sizing
    from tidal.engine.native import fixed_memory

    monkeypatch.setattr(sizing, "sized_by_memory", lambda device: True)
    monkeypatch.setattr(sizing, "available_device_bytes", lambda device: available.pop(0))
    monkeypatch.setattr(fixed_memory, "supported", lambda device: fixed)
    monkeypatch.setattr(fixed_memory, "FixedAddressRegions", _FakeRegions)
    monkeypatch.setattr(fixed_memory, "device_total_bytes", lambda device: 1 << 20)
    _FakeRegions.instances.clear()


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-address", "plain"])
def test_kv_cache_follows_the_memory_available_at_each_wake(monkeypatch, fixed):
    """The KV cache takes kv_cache_memory_fraction of the memory available at each wake-up. At fixed
    addresses every layer's K and V cache stays where it was (so decode graphs stay valid) while the
    number of blocks follows the memory; the new blocks are zeroed; outputs do not change."""
    hf = tiny_hf("qwen2")
    block = 2 * 2 * 4 * 2 * 16 * 4  # layers x (K, V) x 4 tokens x 2 KV heads x 16 dims x 4 bytes
    available = [40 * block, 100 * block, 24 * block, 100 * block]
    _memory_sized(monkeypatch, available, fixed)
    engine = engine_for(hf, block_size=4, kv_cache_memory_fraction=0.5)
    want = [hf_greedy(hf, p, 6) for p in PROMPTS]
    ptrs = None
    for expect_blocks in (19, 49, 11, 49):  # half the memory, less the scratch block
        engine.wake_up()
        runner = engine.runner
        assert runner.num_blocks == engine.block_manager.num_blocks == expect_blocks
        assert engine.memory_report()["kv_cache"] == (expect_blocks + 1) * block
        assert not any(t.any() for t in runner.kv_layers)  # zeroed like a fresh cache
        if fixed:
            (regions,) = _FakeRegions.instances  # reserved once
            assert [t.data_ptr() for t in runner.kv_layers] == (ptrs or [b.data_ptr() for b in regions.bufs])
            ptrs = [t.data_ptr() for t in runner.kv_layers]
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == want
        assert engine.sleep(1) == (expect_blocks + 1) * block
        assert not fixed or not regions.mapped
    assert not available


def test_requests_in_flight_block_sleep_weights_and_generate():
    engine = engine_for(tiny_hf("qwen2"))
    from tidal.engine.base import Request

    engine.add([Request(request_id="a", prompt_ids=[1, 2, 3], params=GREEDY)])
    for call in (lambda: engine.sleep(1), lambda: engine.load_weights([]), lambda: engine.generate([[1]], GREEDY)):
        with pytest.raises(RuntimeError, match="1 unfinished requests: abort"):
            call()
    (partial,) = engine.abort()
    assert partial.finish_reason == "abort" and engine.sleep(1) > 0
