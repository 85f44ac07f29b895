"""VLLMEngine under torchrun on CPU: vLLM's external_launcher inside Tidal's runtime (gloo world).

Two launches of two ranks each: ``tp=2`` (one TP group: both ranks run one vLLM engine, each on its
weight shard) and ``tp=1`` (two vLLM data-parallel replicas with different prompts). Each rank checks
greedy outputs against the HF model, that TP ranks return identical samples without a seed, a
bucketed weight update and a sleep(2) / load_weights / wake_up cycle.

Skipped where vllm is not importable. Run: /work/venv-vllm/bin/pytest -q tests/engine/test_vllm_tp.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tp", [2, 1])
def test_torchrun_two_ranks(tp, tmp_path):
    pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.abspath(__file__), str(tp)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count(f"RANK_OK tp={tp}") == 2, proc.stdout[-3000:]


def _worker(tp: int) -> None:
    import torch
    import torch.distributed as dist

    from tests.engine.helpers import hf_greedy, tiny_hf
    from tidal.distributed.generate import gather_and_generate
    from tidal.distributed.runtime import init_runtime
    from tidal.engine.base import SamplingParams
    from tidal.engine.config import EngineConfig
    from tidal.engine.factory import create_engine

    runtime = init_runtime(tp_size=tp, device="cpu")
    shape = dict(hidden_size=128, intermediate_size=192)
    hf_a, hf_b = tiny_hf("qwen2", seed=0, **shape), tiny_hf("qwen2", seed=1, **shape)
    engine = create_engine(hf_a.config, EngineConfig(backend="vllm", tp_size=tp, dtype="float32", block_size=32,
                                                     kv_cache_max_tokens=2048, max_num_seqs=8, max_num_batched_tokens=128,
                                                     sleep_level=2),
                           device=runtime.device, dtype=torch.float32, tp_group=runtime.tp_group)

    def sync(model):
        items = [(name, p.detach()) for name, p in model.named_parameters()]  # tied lm_head not repeated
        for i in range(0, len(items), 5):
            engine.load_weights(items[i:i + 5])

    # every rank brings its own prompts; gather_and_generate runs one engine call per TP group
    prompts = [[3 + runtime.rank, 17, 99, 5], [11, 12 + runtime.rank]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    def check_greedy(model):
        out = gather_and_generate(engine, prompts, greedy, runtime)
        assert [c.prompt_ids for c in out] == prompts
        assert [c.token_ids for c in out] == [hf_greedy(model, p, 6) for p in prompts], runtime.rank

    sync(hf_a)
    check_greedy(hf_a)

    # unseeded sampling: the TP ranks of a group must draw the same tokens (each rank samples);
    # the replicas of tp=1 draw independent ones
    out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=1.0, max_new_tokens=5, n=2, ignore_eos=True))
    everyone = [None] * runtime.world_size
    dist.all_gather_object(everyone, [c.token_ids for c in out], group=runtime.cpu_group)
    assert (everyone[0] == everyone[1]) == (tp == 2), everyone

    # trainer order: sleep, load new weights while asleep (weights woken only), wake, generate
    engine.sleep(2)
    sync(hf_b)
    engine.wake_up()
    check_greedy(hf_b)
    print(f"RANK_OK tp={tp} rank={runtime.rank}", flush=True)
    dist.barrier(group=runtime.cpu_group)


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
