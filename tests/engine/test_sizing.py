"""Engine sizing (issue 20): the decode batch follows the rollout, the KV cache the memory, and large
batches run without CUDA graphs (CPU; hand-computed numbers)."""

import pytest
import torch

from tidal.config_base import ConfigError, build
from tidal.engine import sizing
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.native.cuda_graphs import DecodeGraphs, graph_buckets
from tidal.engine.native.model_runner import ModelRunner

from .helpers import engine_for, tiny_hf

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


def test_max_num_seqs_is_auto_or_a_positive_integer():
    assert EngineConfig().max_num_seqs == "auto"
    assert build(EngineConfig, {"max_num_seqs": 512}).max_num_seqs == 512
    assert build(EngineConfig, {"max_num_seqs": "auto"}).max_num_seqs == "auto"
    for bad in (0, "many"):
        with pytest.raises(ConfigError, match="max_num_seqs"):
            build(EngineConfig, {"max_num_seqs": bad})
    with pytest.raises(ConfigError, match="cuda_graph_max_batch"):
        EngineConfig(cuda_graph_max_batch=0)
    assert sizing.max_running(EngineConfig()) is None and sizing.max_running(EngineConfig(max_num_seqs=7)) == 7


def test_a_rollout_runs_in_one_wave_unless_max_num_seqs_caps_it():
    hf = tiny_hf("qwen2")
    prompts = [[i % 100 + 1, 7, 9] for i in range(75)]
    params = SamplingParams(temperature=0, max_new_tokens=6, n=4, ignore_eos=True)  # 300 sequences
    auto, capped = engine_for(hf), engine_for(hf, max_num_seqs=100)
    a, c = auto.generate(prompts, params), capped.generate(prompts, params)
    assert [x.token_ids for x in a] == [x.token_ids for x in c]
    assert auto.stats["decode_steps"] == 5  # one wave: the first token comes with the prefill
    assert capped.stats["decode_steps"] == 3 * 5 and auto.stats["preemptions"] == capped.stats["preemptions"] == 0


def test_kv_budget_and_cpu_sizing():
    cfg = EngineConfig(kv_cache_memory_fraction=0.25)
    assert sizing.kv_budget_bytes(cfg, 1000) == 250
    assert sizing.blocks_for_lengths([10, 33, 16], block_size=16, max_seqs=None) == 1 + 3 + 1
    assert sizing.blocks_for_lengths([10, 33, 16], block_size=16, max_seqs=2) == 3 + 1  # the two longest


def test_cuda_graphs_stop_at_cuda_graph_max_batch():
    assert sizing.graph_max_batch(EngineConfig(), CUDA, graph_safe=True) == 512
    assert sizing.graph_max_batch(EngineConfig(cuda_graph_max_batch=2048), CUDA, True) == 2048
    assert sizing.graph_max_batch(EngineConfig(max_num_seqs=64), CUDA, True) == 64
    assert sizing.graph_max_batch(EngineConfig(cuda_graphs=False), CUDA, True) == 0
    assert sizing.graph_max_batch(EngineConfig(), torch.device("cpu"), True) == 0
    assert sizing.graph_max_batch(EngineConfig(), CUDA, graph_safe=False) == 0
    buckets = graph_buckets(2048)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-3:] == [1920, 1984, 2048] and 1024 in buckets
    assert graph_buckets(512)[-2:] == [480, 512] and graph_buckets(100)[-1] == 100
    # the runner replays graphs up to the limit and runs larger batches eagerly
    model = engine_for(tiny_hf("qwen2")).model
    runner = ModelRunner(model, _tp1(), block_size=4,
                         device=torch.device("cpu"), graph_max_batch=24)
    assert isinstance(runner.graphs, DecodeGraphs) and runner.graphs.buckets[-1] == 24
    assert runner.graphs.fits(24) and not runner.graphs.fits(25)


def _tp1():
    from tidal.engine.native.parallel import TPGroup

    return TPGroup.of(None)
