"""Host time per engine step of the native engine on CPU, with a stand-in for the device (issue 20).

The model's forward and LM head are replaced by stubs that cost (almost) nothing and return logits
over a 4-token vocabulary, so what is timed is the engine's own host work per step: scheduling,
input preparation, the launch path, the read-back and the postprocessing of the sampled tokens.
On a GPU that work overlaps the device step (overlap scheduling); it must stay below the device
time per step (about 1-3 ms for a 0.5B model at 512-2048 rows on an H200).

Workload per case: ``seqs / 8`` prompts x 8 samples, ``--prompt-len`` tokens each, ``--new-tokens``
forced (ignore EOS), after a warm-up call. Prints one JSON line per case: wall and process CPU ms
per step of one ``generate`` (all host work, prefill steps included; the CPU figure is the one to
trust on a shared machine), ``decode_step_cpu_ms_marginal`` (the CPU time a decode step adds:
the difference between runs of ``new_tokens`` and ``2 * new_tokens``, over their difference in
steps), ``step_cpu_ms_median`` (median CPU time between consecutive steps) and the engine's timers per step (``stats``: schedule, postprocess, prepare, submit, wait).

Usage: python bench/engine_host.py [--seqs 512,2048] [--new-tokens 128] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import Qwen2Config  # noqa: E402

from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.native import NativeEngine  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=4, max_position_embeddings=4096, tie_word_embeddings=True)


def stub_device(engine: NativeEngine) -> None:
    """Replace the model's forward and LM head by near-free stand-ins (random logits over 4 tokens)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1 << 16, TINY["vocab_size"], generator=g)
    engine.model.forward = lambda ids_T, positions_T, meta, **kw: torch.zeros(ids_T.shape[0], 1)
    engine.model.compute_logits = lambda hidden_BH: logits[: hidden_BH.shape[0]]


def run_case(seqs: int, prompt_len: int, new_tokens: int, **engine_cfg) -> dict:
    cfg = EngineConfig(**{"kv_cache_max_tokens": seqs * (prompt_len + 2 * new_tokens + 16), **engine_cfg})
    engine = NativeEngine(Qwen2Config(**TINY), cfg, device=torch.device("cpu"), dtype=torch.float32)
    stub_device(engine)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4, (prompt_len,), generator=g).tolist() for _ in range(seqs // 8)]
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, n=8, ignore_eos=True))
    runs = {}
    for n_new in (new_tokens, 2 * new_tokens):  # two lengths: their difference is decode steps only
        engine.block_manager.reset_prefix_cache()
        params = SamplingParams(temperature=1.0, max_new_tokens=n_new, n=8, ignore_eos=True, seed=0)
        before = dict(engine.stats)
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine.generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert sum(len(c.token_ids) for c in out) == seqs * n_new
        d = {k: engine.stats[k] - before[k] for k in engine.stats}
        runs[n_new] = (wall, cpu, d)
    wall, cpu, d = runs[new_tokens]
    steps = d["decode_steps"] + d["prefill_steps"]
    (_, cpu2, d2) = runs[2 * new_tokens]
    record = {"seqs": seqs, "prompt_len": prompt_len, "new_tokens": new_tokens, "steps": steps,
              "decode_steps": d["decode_steps"], "prefill_steps": d["prefill_steps"],
              "host_ms_per_step": round(wall / steps * 1e3, 3), "host_cpu_ms_per_step": round(cpu / steps * 1e3, 3),
              "decode_step_cpu_ms_marginal": round((cpu2 - cpu) / (d2["decode_steps"] - d["decode_steps"]) * 1e3, 3),
              "timers_ms_per_step": {k[:-2]: round(d[k] / steps * 1e3, 3) for k in d if k.endswith("_s")},
              "engine": {k: v for k, v in engine_cfg.items()}}
    record["step_cpu_ms_median"] = round(step_cpu_ms_median(engine, prompts, new_tokens), 3)
    return record


def step_cpu_ms_median(engine: NativeEngine, prompts, new_tokens: int) -> float:
    """Median process CPU ms between consecutive waits for a step's tokens, over one ``generate``:
    the host work of one step, decode steps being all but a few."""
    engine.block_manager.reset_prefix_cache()
    marks, wait = [], engine.runner.wait

    def timed_wait(handle):
        marks.append(time.process_time())
        return wait(handle)

    engine.runner.wait = timed_wait
    try:
        engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=8, ignore_eos=True, seed=0))
    finally:
        engine.runner.wait = wait
    return statistics.median(b - a for a, b in zip(marks, marks[1:])) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="512,2048")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], help="engine.KEY=VALUE (int/bool/str)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    extra = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        extra[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    for seqs in [int(s) for s in args.seqs.split(",")]:
        print(json.dumps(run_case(seqs, args.prompt_len, args.new_tokens, **{"max_num_seqs": seqs, **extra})), flush=True)


if __name__ == "__main__":
    main()
