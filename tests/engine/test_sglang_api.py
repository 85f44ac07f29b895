"""The calls SGLangEngine makes, checked against the installed sglang's signatures and fields.

Skipped where sglang is not importable. This checks names and signatures only: SGLang cannot start an
engine on a CPU-only machine (docs/engines-external.md), so no generation is tested here.
Run: /work/venv-sgl/bin/pytest -q tests/engine/test_sglang_api.py
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import Qwen2Config

engine_mod = pytest.importorskip("sglang.srt.entrypoints.engine")

from sglang.srt import constants  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams as SGLSamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, record_fields  # noqa: E402

from tidal.engine import sglang as adapter  # noqa: E402
from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402

pytestmark = pytest.mark.slow  # importing sglang takes ~25 s

CFG = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  vocab_size=128, max_position_embeddings=512, eos_token_id=2)


def test_server_kwargs_are_server_args_fields():
    kw = adapter.server_kwargs(CFG, EngineConfig(sleep_level=2, kv_cache_max_tokens=64), model_dir="/m", dtype=torch.bfloat16,
                               base_gpu_id=0, free=80 << 30, total=100 << 30)
    fields = {f.name for f in record_fields(ServerArgs)}
    assert set(kw) <= fields, set(kw) - fields


def test_engine_methods_accept_the_adapter_calls():
    E = engine_mod.Engine
    calls = {
        "generate": dict(input_ids=[[1, 2]], sampling_params=[{}], return_logprob=True),
        "update_weights_from_tensor": dict(named_tensors=[("w", torch.zeros(1))], flush_cache=False),
        "release_memory_occupation": dict(tags=["kv_cache"]),
        "resume_memory_occupation": dict(tags=["kv_cache"]),
        "flush_cache": {},
        "get_server_info": {},
    }
    for name, kwargs in calls.items():
        inspect.signature(getattr(E, name)).bind(None, **kwargs)


def test_memory_tags_are_sglangs():
    assert {"kv_cache", "cuda_graph", "weights"} == {
        constants.GPU_MEMORY_TYPE_KV_CACHE, constants.GPU_MEMORY_TYPE_CUDA_GRAPH, constants.GPU_MEMORY_TYPE_WEIGHTS}


def test_sampling_dicts_are_valid_sglang_sampling_params():
    for params in (SamplingParams(temperature=0.0, max_new_tokens=4), SamplingParams(temperature=0.8, n=2, seed=3, stop_token_ids=(5,))):
        for d in adapter.sampling_dicts(params, {2}, 2):
            sp = SGLSamplingParams(**d)
            sp.verify(CFG.vocab_size)
            assert sp.no_stop_trim and sp.stop_token_ids == set(d["stop_token_ids"])
