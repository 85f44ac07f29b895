"""Tensor parallelism: 2 gloo ranks on CPU produce exactly what one rank produces.

Covers sharded q/k/v with bias (Qwen2), a replicated single KV head and a vocabulary that does not
divide by the TP size (Llama), greedy and seeded sampling, identical outputs on both ranks, and the
incremental requests in lockstep (partial rollout stopped at complete groups, resumed under new weights),
and Gemma 3's sliding-window layers in their own block pool (KV heads split over the ranks, both
pools' block counts agreed on by the group).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.engine.base import SamplingParams

from .helpers import PROMPTS, engine_for, tiny_hf

CASES = [("qwen2", {}), ("llama", {"num_key_value_heads": 1, "vocab_size": 127})]
PARAMS = [
    SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=30, max_new_tokens=8, n=2, seed=5, ignore_eos=True),
]


def _run(engine):
    return [[(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, p)] for p in PARAMS]


def _incremental(engine, family, overrides):
    """Requests added, stepped, stopped at two complete groups, resumed under other weights: what
    every TP rank must do in lockstep. Returns (request id, tokens, logprobs, versions) per completion."""
    import dataclasses

    from tidal.engine.base import Request
    from tidal.engine.stepping import GroupsComplete, run_steps

    params = SamplingParams(temperature=0.9, max_new_tokens=10, seed=11, ignore_eos=True)
    requests = [Request(request_id=f"{g}/{j}", prompt_ids=p, group_id=g,
                        params=dataclasses.replace(params, max_new_tokens=4 if g % 2 else 10))
                for g, p in enumerate(PROMPTS) for j in range(2)]
    first = run_steps(engine, requests, stop=GroupsComplete(requests, 2))
    engine.load_weights(tiny_hf(family, seed=1, **overrides).state_dict().items())
    engine.policy_version = 1
    rest = run_steps(engine, [Request.resume(c, params) for c in first.unfinished])
    return [(c.request_id, c.token_ids, c.logprobs, c.versions) for c in first.finished + rest.finished]


def _worker(rank: int, store_path: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    results = []
    for family, overrides in CASES:
        hf = tiny_hf(family, **overrides)
        from tidal.engine.config import EngineConfig
        from tidal.engine.native import NativeEngine

        engine = NativeEngine(hf.config, EngineConfig(block_size=4, max_num_batched_tokens=16),
                              device=torch.device("cpu"), dtype=torch.float32, tp_group=group)
        engine.load_weights(hf.state_dict().items())
        assert engine.tp.size == 2 and engine.model.model.layers[0].mlp.down_proj.weight.shape[1] == 48
        results.append((_run(engine), _incremental(engine, family, overrides)))
    windowed = _windowed(group)  # before _blocks_with_unequal_memory, which makes sizing think it is on a GPU
    torch.save((results, _blocks_with_unequal_memory(rank, group), windowed), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _windowed(group):
    """Gemma 3 (window 8 beside full layers) under TP: its window pool's blocks given back and reused."""
    from tests.engine.test_families import tiny
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    hf = tiny("gemma3")
    engine = NativeEngine(hf.config, EngineConfig(block_size=4, max_num_batched_tokens=16), device=torch.device("cpu"),
                          dtype=torch.float32, tp_group=group)
    engine.load_weights(hf.state_dict().items())
    assert engine.runner.window == 8 and engine.window_blocks is None  # allocated with the first request
    out = _run(engine)
    return out, engine.window_blocks.num_blocks


def _blocks_with_unequal_memory(rank, group):
    """Each rank sizes its KV cache from its own free memory (here rank r sees (r + 1) x 64 blocks' worth
    at half the fraction): the ranks must still agree on the blocks they schedule."""
    from tidal.engine import sizing
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    hf = tiny_hf("qwen2")
    engine = NativeEngine(hf.config, EngineConfig(block_size=4, kv_cache_memory_fraction=0.5), device=torch.device("cpu"),
                          dtype=torch.float32, tp_group=group)
    engine.load_weights(hf.state_dict().items())
    sizing.sized_by_memory = lambda device: True
    sizing.available_device_bytes = lambda device: (rank + 1) * 64 * engine.runner.block_bytes()
    engine.wake_up()
    out = engine.generate(PROMPTS, PARAMS[0])
    return engine.runner.num_blocks, engine.block_manager.num_blocks, [c.token_ids for c in out]


@pytest.mark.slow
def test_tp2_gloo_equals_tp1(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    (r0, sized0, win0), (r1, sized1, win1) = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0 == r1 and win0 == win1  # every TP rank returns the same completions
    from tests.engine.test_families import tiny

    tp1 = engine_for(tiny("gemma3"), block_size=4, max_num_batched_tokens=16)
    for runs1, runs2 in zip(_run(tp1), win0[0]):
        assert [t for t, _ in runs1] == [t for t, _ in runs2]
        for (_, lp1), (_, lp2) in zip(runs1, runs2):
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)
    assert win0[1] == tp1.window_blocks.num_blocks
    assert (sized0[0], sized1[0]) == (31, 63)  # half of 64 or 128 blocks, less the scratch block
    assert sized0[1] == sized1[1] == 31 and sized0[2] == sized1[2]  # both schedule over the smaller cache
    for (family, overrides), (tp2, inc2) in zip(CASES, r0):
        engine = engine_for(tiny_hf(family, **overrides), block_size=4, max_num_batched_tokens=16)
        tp1 = _run(engine)
        for runs1, runs2 in zip(tp1, tp2):
            assert [t for t, _ in runs1] == [t for t, _ in runs2]
            for (_, lp1), (_, lp2) in zip(runs1, runs2):
                assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)
        inc1 = _incremental(engine, family, overrides)
        assert len(inc1) == 8 and {v for *_, vs in inc1 for v in vs} == {0, 1}  # some tokens resumed under new weights
        assert [(i, t, v) for i, t, _, v in inc1] == [(i, t, v) for i, t, _, v in inc2]
        for (*_, lp1, _), (*_, lp2, _) in zip(inc1, inc2):
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)
