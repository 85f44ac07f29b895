"""SGLangEngine's own logic against a fake ``sglang.Engine`` with sglang 0.5.23's method signatures.

This is NOT a test of SGLang: no SGLang engine runs on these CPU-only machines (see
docs/engines-external.md). It checks what the adapter decides: arguments, the explicit sleep tags,
the staged wake-up, that only the first rank of a TP group drives the engine and that the other
ranks receive its completions (2 ranks over gloo).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config

from tidal.engine import sglang as adapter
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig

CFG = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  vocab_size=128, max_position_embeddings=512, eos_token_id=2)


def test_mem_fraction_static_leaves_the_asked_share_to_kv():
    # total 100, free 80, weights 20: room 60; kv_fraction 0.5 -> KV 30 = room - total*(1-f) -> f = 0.7
    assert adapter.mem_fraction_static(free=80, total=100, weights=20, kv_fraction=0.5) == pytest.approx(0.7)
    with pytest.raises(RuntimeError, match="no device memory"):
        adapter.mem_fraction_static(free=10, total=100, weights=20, kv_fraction=0.5)


def test_server_kwargs():
    kw = adapter.server_kwargs(CFG, EngineConfig(tp_size=2, block_size=16, max_num_seqs=9, max_num_batched_tokens=512,
                                                 enable_prefix_caching=False, cuda_graphs=False, sleep_level=2,
                                                 kv_cache_max_tokens=4096),
                               model_dir="/m", dtype=torch.bfloat16, base_gpu_id=2, free=80 << 30, total=100 << 30)
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and kw["dtype"] == "bfloat16"
    assert (kw["tp_size"], kw["base_gpu_id"], kw["max_running_requests"], kw["chunked_prefill_size"], kw["page_size"]) == (2, 2, 9, 512, 16)
    assert kw["disable_radix_cache"] and kw["disable_cuda_graph"] and kw["max_total_tokens"] == 4096
    assert kw["enable_memory_saver"] and kw["enable_weights_cpu_backup"]
    kw1 = adapter.server_kwargs(CFG, EngineConfig(sleep_level=1), model_dir="/m", dtype=torch.bfloat16, base_gpu_id=0,
                                free=80 << 30, total=100 << 30)
    assert kw1["enable_memory_saver"] and not kw1["enable_weights_cpu_backup"] and "max_total_tokens" not in kw1


def test_sampling_dicts():
    d = adapter.sampling_dicts(SamplingParams(temperature=0.6, max_new_tokens=7, n=2, stop_token_ids=(9,), seed=40), {2}, 2)
    assert len(d) == 4 and [x["sampling_seed"] for x in d] == [40, 41, 42, 43]
    assert d[0] == dict(temperature=0.6, max_new_tokens=7, stop_token_ids=[2, 9], ignore_eos=False, no_stop_trim=True,
                        sampling_seed=40)
    assert "sampling_seed" not in adapter.sampling_dicts(SamplingParams(ignore_eos=True), {2}, 1)[0]
    assert adapter.sampling_dicts(SamplingParams(ignore_eos=True), {2}, 1)[0]["stop_token_ids"] == []
    for bad in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        with pytest.raises(ValueError, match="top-k/top-p"):
            adapter.sampling_dicts(SamplingParams(**bad), set(), 1)


def _result(triples, reason="length"):
    return {"output_ids": [t for _, t, _ in triples], "meta_info": {"finish_reason": {"type": reason}, "output_token_logprobs": triples}}


def test_to_completions():
    c = adapter.to_completions([[1, 2], [3]], [_result([(-0.5, 7, None), (-0.1, 2, None)], "stop"), _result([(-2.0, 4, None)])])
    assert [(x.prompt_ids, x.token_ids, x.logprobs, x.finish_reason) for x in c] == [
        ([1, 2], [7, 2], [-0.5, -0.1], "stop"), ([3], [4], [-2.0], "length")]
    with pytest.raises(RuntimeError, match="abort"):
        adapter.to_completions([[1]], [_result([(-1.0, 4, None)], "abort")])


def test_cpu_device_refused():
    with pytest.raises(ValueError, match="CUDA"):
        adapter.require_cuda(torch.device("cpu"))


class FakeEngine:
    """Method signatures of sglang 0.5.23's Engine; records calls, tracks released tags."""

    instances: list["FakeEngine"] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.released = kwargs, [], set()
        FakeEngine.instances.append(self)

    def get_server_info(self):
        return {"max_total_num_tokens": 1000}

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, **kw):
        assert return_logprob and not self.released
        self.calls.append(("generate", len(input_ids)))
        return [_result([(-0.25, 5 + i, None)]) for i in range(len(input_ids))]

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert "weights" not in self.released
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache, "kv_cache" in self.released))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))
        self.released |= set(tags)

    def resume_memory_occupation(self, tags=None):
        assert set(tags) <= self.released, "SGLang raises on resuming a tag that was not released"
        self.calls.append(("resume", tuple(tags)))
        self.released -= set(tags)

    def flush_cache(self):
        self.calls.append("flush")


def _install_fake(monkeypatch):
    FakeEngine.instances.clear()
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(adapter, "check_backend_installed", lambda backend: "0.5.23")
    monkeypatch.setattr(adapter, "require_cuda", lambda device: None)
    monkeypatch.setattr(adapter, "device_free_bytes", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 100 << 30))


def _engine(**cfg):
    return adapter.SGLangEngine(CFG, EngineConfig(**cfg), device=torch.device("cuda:0"), dtype=torch.bfloat16)


def test_sleep_tags_and_staged_wake(monkeypatch):
    _install_fake(monkeypatch)
    engine = _engine(sleep_level=2)
    fake = FakeEngine.instances[0]
    assert engine.memory_report()["kv_cache"] == 1000 * adapter.kv_bytes_per_token(CFG, torch.bfloat16, 1)
    engine.sleep(2)
    assert fake.calls == [("release", ("kv_cache", "cuda_graph", "weights"))]
    engine.load_weights([("a", torch.zeros(1)), ("b", torch.zeros(1))])
    engine.load_weights([("c", torch.zeros(1))])
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate([[1]], SamplingParams())
    engine.wake_up()
    out = engine.generate([[1], [2, 3]], SamplingParams(n=2))
    assert fake.calls[1:] == [("resume", ("weights",)), ("update", ["a", "b"], False, True), ("update", ["c"], False, True),
                              ("resume", ("kv_cache", "cuda_graph")), "flush", ("generate", 4)]
    assert [c.prompt_ids for c in out] == [[1], [1], [2, 3], [2, 3]] and out[1].token_ids == [6]
    fake.calls.clear()
    engine.sleep(1)
    assert engine.sleep(1) == 0
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.sleep(2)
    engine.wake_up()
    engine.generate([[1]], SamplingParams())
    assert fake.calls == [("release", ("kv_cache", "cuda_graph")), ("resume", ("kv_cache", "cuda_graph")), ("generate", 1)]


def test_sleep_refused_without_memory_saver(monkeypatch):
    _install_fake(monkeypatch)
    engine = _engine(sleep_level=0)
    assert FakeEngine.instances[0].kwargs["enable_memory_saver"] is False
    with pytest.raises(RuntimeError, match="sleep_level=0"):
        engine.sleep(1)


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    monkeypatch = pytest.MonkeyPatch()
    _install_fake(monkeypatch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    engine = adapter.SGLangEngine(CFG, EngineConfig(tp_size=2), device=torch.device(f"cuda:{rank}"), dtype=torch.bfloat16,
                                  tp_group=group)
    engine.load_weights([("w", torch.full((1,), float(rank)))])
    out = engine.generate([[7], [8]], SamplingParams())
    engine.sleep(1)
    engine.wake_up()
    calls = FakeEngine.instances[0].calls if FakeEngine.instances else None
    kwargs = FakeEngine.instances[0].kwargs if FakeEngine.instances else None
    torch.save(dict(out=[(c.prompt_ids, c.token_ids, c.logprobs) for c in out], calls=calls, kwargs=kwargs,
                    kv=engine.memory_report()["kv_cache"]), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_first_rank_drives_the_engine(tmp_path):
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r1["calls"] is None  # the second rank holds no engine
    assert r0["kwargs"]["tp_size"] == 2 and r0["kwargs"]["base_gpu_id"] == 0
    assert r0["calls"] == [("update", ["w"], False, False), "flush", ("generate", 2),
                           ("release", ("kv_cache", "cuda_graph")), ("resume", ("kv_cache", "cuda_graph"))]
    assert r0["out"] == r1["out"] == [([7], [5], [-0.25]), ([8], [6], [-0.25])]
    assert r0["kv"] == r1["kv"] > 0
