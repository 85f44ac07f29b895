"""VLLMEngine's own logic, without vLLM: argument mapping, completions, the explicit sleep-level mapping
and the staged wake-up, against a fake ``vllm.LLM`` that follows vLLM 0.32's documented semantics
(sleep levels 0/1/2, ``release_kv_cache_memory``, ``wake_up(tags)`` returning "fully awake").
The real engine is exercised by test_vllm_cpu.py / test_vllm_tp.py where vLLM is installed."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidal.config_base import ConfigError
from tidal.engine import backends
from tidal.engine import vllm as adapter
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig

CFG = Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  vocab_size=128, max_position_embeddings=4096, eos_token_id=[1, 2])


# ---- pure helpers ---------------------------------------------------------------------------------
def test_kv_bytes_per_token_hand_computed():
    # 2 (K,V) * 3 layers * 2 kv heads * head_dim 16 * 2 bytes
    assert adapter.kv_bytes_per_token(CFG, torch.bfloat16, 1) == 2 * 3 * 2 * 16 * 2
    assert adapter.kv_bytes_per_token(CFG, torch.float32, 2) == 2 * 3 * 1 * 16 * 4
    assert adapter.kv_bytes_per_token(CFG, torch.float32, 4) == 2 * 3 * 1 * 16 * 4  # KV heads replicated


def test_weight_bytes_counts_parameters_per_rank():
    n = sum(p.numel() for p in Qwen2ForCausalLM(CFG).parameters())
    assert adapter.weight_bytes_per_rank(CFG, torch.bfloat16, 1) == 2 * n
    assert adapter.weight_bytes_per_rank(CFG, torch.float32, 2) == 4 * n // 2


def _kwargs(device="cpu", world=1, **cfg):
    base = dict(block_size=32, kv_cache_max_tokens=1000)
    return adapter.llm_kwargs(CFG, EngineConfig(**{**base, **cfg}), model_dir="/m", device=torch.device(device),
                              dtype=torch.float32, world_size=world, free_bytes=50, total_bytes=100)


def test_llm_kwargs_single_process_cpu():
    kw = _kwargs(max_num_seqs=7, max_num_batched_tokens=300, enable_prefix_caching=False)
    assert kw["distributed_executor_backend"] == "uni" and "data_parallel_size" not in kw
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and kw["generation_config"] == "vllm"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["dtype"] == "float32"
    assert kw["kv_cache_memory_bytes"] == 1000 * (2 * 3 * 2 * 16 * 4)
    assert kw["max_model_len"] == 1000  # capped by the KV cache, below max_position_embeddings=4096
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["enable_prefix_caching"]) == (7, 300, False)
    assert kw["enforce_eager"] and not kw["enable_sleep_mode"]  # CPU: no CUDA graphs, no sleep mode
    assert "gpu_memory_utilization" not in kw


def test_llm_kwargs_torchrun_world_cuda():
    kw = _kwargs("cuda", world=4, tp_size=2, block_size=16, cuda_graphs=True, sleep_level=2)
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["data_parallel_size"] == 2
    assert kw["tensor_parallel_size"] == 2 and not kw["enforce_eager"] and kw["enable_sleep_mode"]
    assert kw["gpu_memory_utilization"] == 0.49  # vLLM's start-up check asks for what is free (50 of 100)
    assert not _kwargs("cuda", sleep_level=0, block_size=16)["enable_sleep_mode"]


@pytest.mark.parametrize("cfg,key", [
    (dict(block_size=16), "engine.block_size"),
    (dict(kv_cache_max_tokens=0), "engine.kv_cache_max_tokens"),
])
def test_llm_kwargs_refuses_what_vllm_cannot_do(cfg, key):
    with pytest.raises(ConfigError) as e:
        _kwargs(world=2, **cfg)
    assert e.value.key == key


def test_kv_cache_from_free_cuda_memory(monkeypatch):
    monkeypatch.setattr(adapter, "weight_bytes_per_rank", lambda *a: 1000)
    cfg = EngineConfig(kv_cache_memory_fraction=0.5)
    assert adapter.kv_cache_bytes(CFG, cfg, dtype=torch.float32, device=torch.device("cuda"), free_bytes=101000) == 50000
    with pytest.raises(RuntimeError, match="no device memory"):
        adapter.kv_cache_bytes(CFG, cfg, dtype=torch.float32, device=torch.device("cuda"), free_bytes=1000)


def test_sampling_kwargs_stop_tokens_and_logprobs():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_new_tokens=9, n=3, stop_token_ids=(7,), seed=11)
    kw = adapter.sampling_kwargs(p, {1, 2})
    assert kw == dict(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_tokens=9, stop_token_ids=[1, 2, 7], ignore_eos=False,
                      seed=11, logprobs=0, detokenize=False)
    kw = adapter.sampling_kwargs(SamplingParams(stop_token_ids=(7,), ignore_eos=True), {1, 2})
    assert kw["stop_token_ids"] == [7] and kw["ignore_eos"]
    assert adapter.eos_ids(CFG) == {1, 2} and adapter.eos_ids(Qwen2Config(eos_token_id=None)) == set()


def _out(rid, prompt, comps):
    outputs = [types.SimpleNamespace(index=i, token_ids=toks, logprobs=[{t: types.SimpleNamespace(logprob=lp)} for t, lp in zip(toks, lps)],
                                     finish_reason=fr) for i, (toks, lps, fr) in comps]
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt, outputs=outputs)


def test_to_completions_prompt_major_by_index():
    outs = [_out("0", [5], [(1, ([9], [-0.5], "length")), (0, ([8, 1], [-0.1, -0.2], "stop"))]),
            _out("1", [6, 7], [(0, ([3], [-1.0], "length"))])]
    c = adapter.to_completions(outs)
    assert [(x.prompt_ids, x.token_ids, x.logprobs, x.finish_reason) for x in c] == [
        ([5], [8, 1], [-0.1, -0.2], "stop"), ([5], [9], [-0.5], "length"), ([6, 7], [3], [-1.0], "length")]
    with pytest.raises(RuntimeError, match="abort"):
        adapter.to_completions([_out("2", [5], [(0, ([4], [-1.0], "abort"))])])


# ---- optional-backend version checks -----------------------------------------------------------------------
def test_check_backend_installed(monkeypatch):
    from tidal import optional_deps

    assert backends.check_backend_installed("native") == ""
    monkeypatch.setattr(optional_deps.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"engine.backend.*vllm >=0.32,<0.34; vllm is not installed: pip install 'tidal-rft\[vllm\]'"):
        backends.check_backend_installed("vllm")
    monkeypatch.setattr(optional_deps.importlib.util, "find_spec", lambda name: object())
    for version, ok in [("0.31.9", False), ("0.32.0", True), ("0.33.5.dev3+g12", True), ("0.34.0", False)]:
        monkeypatch.setattr(optional_deps.importlib.metadata, "version", lambda dist, v=version: v)
        if ok:
            assert backends.check_backend_installed("vllm") == version
        else:
            with pytest.raises(ConfigError, match=f"installed vllm {version} is outside"):
                backends.check_backend_installed("vllm")


# ---- the sleep / wake / weight-update state machine against a fake vllm.LLM ------------------------
class FakeLLM:
    """Follows vLLM 0.32's documented semantics; records every call; tracks device memory."""

    WEIGHTS, KV = 1000, 300

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list = []
        self.sleeping: set[str] = set()  # executor memory tags released
        self.paused = False
        self.llm_engine = types.SimpleNamespace(step=lambda: self.calls.append("step"), model_config="MC")
        self.kv_resident_during_load: list[bool] = []

    def used(self) -> int:
        return (0 if "weights" in self.sleeping else self.WEIGHTS) + (0 if "kv_cache" in self.sleeping else self.KV)

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))
        self.paused = True
        if level == 1:
            self.sleeping |= {"weights", "kv_cache"}

    def release_kv_cache_memory(self):
        assert self.paused and not self.sleeping, "vLLM requires a completed pause and resident memory"
        self.calls.append("release_kv")
        self.sleeping.add("kv_cache")

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        assert set(tags) <= {"weights", "kv_cache", "scheduling"}
        self.sleeping -= set(tags)
        if not self.sleeping:
            self.paused = False
        return not self.sleeping

    def apply_model(self, fn):
        name = getattr(fn, "func", fn).__name__
        self.calls.append(name)
        if name == "_load":
            assert "weights" not in self.sleeping, "load into released weights"
            self.kv_resident_during_load.append("kv_cache" not in self.sleeping)
        return [None]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def generate(self, inputs, sp, use_tqdm=True):
        assert not self.paused
        self.calls.append("generate")
        return [_out(str(i), x["prompt_token_ids"], [(j, ([4], [-0.25], "length")) for j in range(sp["n"])])
                for i, x in enumerate(inputs)]


@pytest.fixture
def fake(monkeypatch):
    """A VLLMEngine on a fake CUDA device over FakeLLM, with free memory read off the fake."""
    holder = {}

    def make_llm(**kwargs):
        holder["llm"] = FakeLLM(**kwargs)
        return holder["llm"]

    module = types.SimpleNamespace(LLM=make_llm, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(adapter, "check_backend_installed", lambda backend: "0.32.0")
    monkeypatch.setattr(adapter, "_own_rng", lambda device, seed=None: contextlib.nullcontext())
    monkeypatch.setattr(adapter, "device_free_bytes", lambda device: 10_000 - holder["llm"].used() if "llm" in holder else 10_000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000, 20_000))

    def build(**cfg):
        engine = adapter.VLLMEngine(CFG, EngineConfig(**{"kv_cache_max_tokens": 64, **cfg}), device=torch.device("cuda"),
                                    dtype=torch.bfloat16)
        return engine, holder["llm"]

    return build


def test_level1_frees_kv_only_and_wakes_it(fake):
    engine, llm = fake(sleep_level=1)
    assert engine.sleep(1) == FakeLLM.KV
    assert llm.calls == ["step", ("sleep", 0), "release_kv"]  # vLLM level 0 + release: weights stay resident
    assert engine.memory_report()["kv_cache"] == 0 and engine.memory_report()["weights"] > 0
    assert engine.sleep(1) == 0  # already asleep
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.sleep(2)
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate([[1]], SamplingParams())
    llm.calls.clear()
    assert engine.wake_up() == FakeLLM.KV
    assert llm.calls == [("wake_up", ("kv_cache",))] and not llm.paused
    assert engine.wake_up() == 0


def test_level2_offloads_weights_and_weight_sync_wakes_weights_only(fake):
    engine, llm = fake(sleep_level=2)
    assert engine.sleep(2) == FakeLLM.WEIGHTS + FakeLLM.KV
    assert llm.calls == ["step", ("sleep", 1)]  # vLLM level 1 offloads weights; vLLM level 2 would discard them
    llm.calls.clear()
    engine.load_weights([("a", torch.zeros(1)), ("b", torch.zeros(1))])
    engine.load_weights(iter([("c", torch.zeros(1))]))
    assert llm.calls == [("wake_up", ("weights",)), "_begin_reload", "_load", "_load"]
    assert llm.kv_resident_during_load == [False, False]  # no KV cache while weights are loaded
    with pytest.raises(RuntimeError, match="sleeping"):
        engine.generate([[1]], SamplingParams())  # the KV cache is still released
    llm.calls.clear()
    assert engine.wake_up() == FakeLLM.KV  # only the KV cache comes back now
    assert llm.calls == ["_finish_reload", "reset_prefix_cache", ("wake_up", ("kv_cache",))]


def test_update_closed_by_generate_and_sleep(fake):
    engine, llm = fake()
    engine.load_weights([("a", torch.zeros(1))])
    engine.load_weights([])
    out = engine.generate([[3, 4], [5]], SamplingParams(n=2))
    assert llm.calls == ["_begin_reload", "_load", "_finish_reload", "reset_prefix_cache", "generate"]
    assert [c.prompt_ids for c in out] == [[3, 4], [3, 4], [5], [5]]
    llm.calls.clear()
    engine.load_weights([("a", torch.zeros(1))])
    engine.sleep(1)
    assert llm.calls == ["_begin_reload", "_load", "_finish_reload", "reset_prefix_cache", "step", ("sleep", 0), "release_kv"]


def test_sleep_refused_when_started_without_sleep_mode(fake):
    engine, llm = fake(sleep_level=0)
    assert llm.kwargs["enable_sleep_mode"] is False
    with pytest.raises(RuntimeError, match="sleep_level=0"):
        engine.sleep(1)
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)


def test_call_seed_differs_by_call_and_replica_in_31_bits():
    seeds = {adapter.call_seed(r, c) for r in range(4) for c in range(1, 200)}
    assert len(seeds) == 4 * 199 and max(seeds) < 2**31
    assert adapter.call_seed(1, 5) == adapter.call_seed(1, 5)


def test_tied_embeddings_are_loaded_under_their_alias():
    tied = Qwen2Config(**{**CFG.to_dict(), "tie_word_embeddings": True})
    aliases = adapter.tied_aliases(tied)
    assert aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert adapter.tied_aliases(Qwen2Config(**{**CFG.to_dict(), "tie_word_embeddings": False})) == {}
    e, n = torch.zeros(2), torch.ones(1)
    assert adapter.with_aliases([("model.norm.weight", n), ("model.embed_tokens.weight", e)], aliases) == [
        ("model.norm.weight", n), ("model.embed_tokens.weight", e), ("lm_head.weight", e)]
    both = [("model.embed_tokens.weight", e), ("lm_head.weight", n)]
    assert adapter.with_aliases(both, aliases) == both  # an explicit lm_head.weight is not doubled
