"""Rollout-engine benchmark on one GPU (issue 3). Prints one JSON line per figure and appends them to
``--out`` (default ``bench/results/rollout.jsonl``) with the commit, device and settings.

Model: a random-initialised Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings, bf16). Cases:
- ``main``: 16 prompts x 8 samples = 128 sequences, prompt 128 tokens, 256 new tokens forced
  (ignore EOS), temperature 1.0; also HF ``generate`` (dynamic cache) on the same model and prompts.
- ``mixed``: 32 prompts x 8 samples, prompt lengths uniform in 64-512, up to 1024 new tokens ended
  by stop tokens (a random model's EOS is never sampled, so ``--stop-ids`` token ids act as EOS:
  each step stops with probability ~stop_ids/vocab, a geometric length capped at 1024).
- ``512``, ``2048``: 64 / 256 prompts x 8 samples, otherwise like ``main``.
- ``partial``: the ``mixed`` workload through the incremental requests, stopped once 24 of its 32
  groups are complete (``tidal.engine.stepping.run_steps`` with ``GroupsComplete``); the long tail is left unfinished.

Every native case records the host time per engine step (``host_ms_per_step``: the engine's timers,
``host_busy_ms_per_step``: all of them but ``wait``) next to the wall time per step
(``wall_ms_per_step``): host work hides behind the device step while ``host_busy`` stays below it
and the step was scheduled ahead (``ahead_frac``: decode steps scheduled ahead over all decode
steps; ``ahead_off_frac``: the steps after which the next was not, by reason, over all steps).
The engine runs with its defaults (``max_num_seqs: auto``, the KV cache sized from free memory), so
each case decodes in one wave.

Roofline: bytes every decode step must read (all weights once, LM head included, plus the KV of
every running sequence) over the measured device copy bandwidth (bytes read + written per second).
Variants of ``main``: overlap scheduling off, cuBLASLt preferred (``--no-graph-variant`` adds eager);
``--compare-graphs`` times the cases above ``engine.cuda_graph_max_batch`` (eager decode by default)
again with a graph of their batch, and records the graph pool's bytes.
``--check`` first verifies the CUDA engine: exact greedy equality with HF on tiny fp32 models
(Qwen2, Qwen3, Llama; Triton kernels and CUDA graphs), and bf16 logprob agreement on the 0.5B model.

Usage: python bench/rollout.py [--check] [--cases main,mixed,512,2048,partial] [--hf-new-tokens 256] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tidal import families  # noqa: E402
from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.native import NativeEngine  # noqa: E402

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                 tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)


def emit(record: dict, sink: list) -> None:
    print(json.dumps(record), flush=True)
    sink.append(record)


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of 20)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def make_hf_model(dtype=torch.bfloat16):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).to(dtype).eval()
    return model


def make_engine(hf_model, **cfg) -> NativeEngine:
    engine = NativeEngine(hf_model.config, EngineConfig(**cfg), device=torch.device("cuda"), dtype=torch.bfloat16)
    engine.load_weights((n, p.detach()) for n, p in hf_model.state_dict().items())
    engine.wake_up()
    return engine


def prompts_of(n_prompts: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths[:n_prompts]]


def kv_bytes_per_token(cfg) -> int:
    """bf16 K and V bytes of one token over the layers that keep KV, as the model's family declares."""
    return families.kv_bytes_per_token(families.layer_caches(cfg), 2, 1)


def roofline(completions, engine, decode_steps: int, bw: float) -> dict:
    """Ideal decode time: each step reads all weights once plus the KV of each running sequence,
    and reads and writes the recurrent state of each (hybrid models: linear-attention layers)."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    per_tok = kv_bytes_per_token(engine.model.config)
    state = families.state_bytes_per_sequence(families.layer_caches(engine.model.config), 1)
    kv = states = 0
    for c in completions:
        p, o = len(c.prompt_ids), len(c.token_ids)
        kv += per_tok * ((p + o - 1) * (p + o) // 2 - p * (p + 1) // 2)  # contexts p+1 .. p+o-1
        states += 2 * state * (o - 1)  # each decode step reads and writes it
    total = decode_steps * weights + kv + states
    return {"roofline_s": total / bw, "bytes_read": total, "weight_bytes": weights, "kv_bytes_read": kv,
            "state_bytes": states}


def time_engine(engine, prompts, params, repeats: int = 2):
    """Generate ``repeats`` times (the first compiles kernels and captures graphs); stats of the last,
    and its host milliseconds per step."""
    for _ in range(repeats):
        engine.block_manager.reset_prefix_cache()  # no reuse of the previous repeat's prompts
        before = dict(engine.stats)
        t0 = sync_time()
        out = engine.generate(prompts, params)
        wall = sync_time() - t0
    steps = {k: engine.stats[k] - before[k] for k in engine.stats}
    return out, wall, steps, {**engine.host_ms_per_step(before), "overlap": engine.overlap(before)}


def bench_native(case: str, engine, prompts, params, bw, variant: str, sink, settings) -> None:
    out, wall, steps, host = time_engine(engine, prompts, params)
    gen = sum(len(c.token_ids) for c in out)
    lens = sorted(len(c.token_ids) for c in out)
    rl = roofline(out, engine, steps["decode_steps"], bw)
    emit({"case": case, "engine": "native", "variant": variant, "seqs": len(out), "generated_tokens": gen,
          "wall_s": round(wall, 4), "gen_tokens_per_s": round(gen / wall, 1),
          "decode_steps": steps["decode_steps"], "prefill_steps": steps["prefill_steps"],
          "prefill_tokens": steps["prefill_tokens"], "prefix_hit_tokens": steps["prefix_hit_tokens"],
          "preemptions": steps["preemptions"], "out_len_min_med_max": [lens[0], lens[len(lens) // 2], lens[-1]],
          "roofline_tokens_per_s": round(gen / rl["roofline_s"], 1), "roofline_fraction": round(rl["roofline_s"] / wall, 4),
          "bytes_read_per_decode_step_MB": round(rl["bytes_read"] / max(1, steps["decode_steps"]) / 1e6, 1),
          "host_ms_per_step": {k: round(v, 3) for k, v in host.items() if k not in ("steps", "overlap")},
          "host_busy_ms_per_step": round(sum(v for k, v in host.items() if k not in ("steps", "wait", "overlap")), 3),
          "ahead_frac": round(host["overlap"]["ahead_frac"], 4),
          "ahead_off_frac": {k[4:]: round(v, 4) for k, v in host["overlap"].items() if k.startswith("off_")},
          "wall_ms_per_step": round(wall / max(1, host["steps"]) * 1e3, 3),
          "kv_blocks": engine.block_manager.num_blocks, "max_num_seqs": engine.cfg.max_num_seqs,
          **settings}, sink)


def bench_partial(engine, prompts, params, groups_needed: int, sink, settings) -> None:
    """The ``mixed`` workload through the incremental requests, stopped once ``groups_needed``
    groups are complete (partial rollout): the unfinished sequences are returned, not waited for."""
    from tidal.engine.base import Request, require_incremental
    from tidal.engine.stepping import GroupsComplete, run_steps

    incremental = require_incremental(engine, "the partial case")
    one = dataclasses.replace(params, n=1)
    requests = [Request(request_id=i * params.n + j, prompt_ids=p, params=one, group_id=i)
                for i, p in enumerate(prompts) for j in range(params.n)]
    for _ in range(2):  # the first compiles kernels and captures graphs
        engine.block_manager.reset_prefix_cache()
        t0 = sync_time()
        rule = GroupsComplete(requests, groups_needed)
        got = run_steps(incremental, requests, stop=rule)
        wall = sync_time() - t0
    done, left = sum(len(c.token_ids) for c in got.finished), sum(len(c.token_ids) for c in got.unfinished)
    emit({"case": "partial", "engine": "native", "groups_needed": groups_needed,
          "complete_groups": len(rule.completed), "finished": len(got.finished), "unfinished": len(got.unfinished),
          "steps": got.steps, "wall_s": round(wall, 4), "generated_tokens": done + left,
          "gen_tokens_per_s": round((done + left) / wall, 1), "finished_tokens": done, **settings}, sink)


def bench_hf(model, prompts, n: int, new_tokens: int, sink, settings) -> None:
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n, pad_token_id=0,
              max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    with torch.inference_mode():
        model.generate(ids[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = sync_time()
        out = model.generate(ids, **kw)
        wall = sync_time() - t0
    gen = (out.shape[1] - ids.shape[1]) * out.shape[0]
    emit({"case": "main", "engine": "hf_generate", "variant": "dynamic_cache", "seqs": out.shape[0],
          "generated_tokens": gen, "new_tokens_per_seq": new_tokens, "wall_s": round(wall, 3),
          "gen_tokens_per_s": round(gen / wall, 1), **settings}, sink)


def step_breakdown(engine, bs: int, sink, settings) -> None:
    """GPU time of one decode graph replay (model forward) and of LM head + sampling at ``bs`` rows."""
    graphs = engine.runner.graphs
    if graphs is None or bs not in graphs.graphs:
        return
    g = graphs.graphs[bs]

    def timed(fn, n=50):
        fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n * 1e3  # us

    from tidal.engine.sampler import sample

    hidden = graphs.bufs["hidden"][:bs]
    fwd = timed(g.replay)
    head = timed(lambda: engine.model.compute_logits(hidden))
    logits = engine.model.compute_logits(hidden)
    samp = timed(lambda: sample(logits, 1.0))

    def device_step():  # what a step costs with no scheduling: replay, head, sample, read back
        g.replay()
        tok, logp = sample(engine.model.compute_logits(hidden), 1.0)
        torch.stack([tok.double(), logp.double()]).cpu()

    device_step()
    t0 = time.perf_counter()
    for _ in range(50):
        device_step()
    loop = (time.perf_counter() - t0) / 50 * 1e6
    emit({"case": "main", "figure": "decode_step_breakdown_us", "batch": bs, "graph_forward_us": round(fwd, 1),
          "lm_head_us": round(head, 1), "sample_us": round(samp, 1), "synced_device_step_us": round(loop, 1),
          **settings}, sink)


def check_tiny_exact(sink, settings) -> None:
    """Greedy tokens equal HF on tiny fp32 models with Triton kernels + CUDA graphs on the GPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "engine"))
    from helpers import PROMPTS, tiny_hf  # type: ignore

    for family in ("qwen2", "qwen3", "llama"):
        hf = tiny_hf(family).cuda()
        engine = NativeEngine(hf.config, EngineConfig(block_size=4, max_num_batched_tokens=16, kv_cache_max_tokens=4096),
                              device=torch.device("cuda"), dtype=torch.float32)
        engine.load_weights(hf.state_dict().items())
        out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
        equal = []
        for p, c in zip(PROMPTS, out):
            ref = hf.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=16,
                              min_new_tokens=16, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            equal.append(c.token_ids == ref)
        emit({"check": "greedy_equals_hf_fp32_cuda", "family": family, "graphs": engine.runner.graphs is not None,
              "kernels": type(engine.ops).__name__, "all_equal": all(equal), "per_prompt": equal, **settings}, sink)
        del engine, hf
    torch.cuda.empty_cache()


def check_05b_logprobs(hf_model, engine, sink, settings) -> None:
    """Engine (bf16) sampled logprobs vs an fp32 reference forward, next to HF bf16's own error."""
    prompts = prompts_of(4, [128] * 4, QWEN2_05B["vocab_size"], seed=7)
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, n=2, seed=0, ignore_eos=True))
    ref32 = make_hf_model(torch.float32)
    errs_engine, errs_hf = [], []
    with torch.inference_mode():
        for c in out:
            seq = torch.tensor([c.prompt_ids + c.token_ids], device="cuda")
            toks = seq[0, len(c.prompt_ids):, None]
            sl = slice(len(c.prompt_ids) - 1, -1)
            lp32 = torch.log_softmax(ref32(seq).logits[0, sl].float(), -1).gather(-1, toks).squeeze(-1)
            lp16 = torch.log_softmax(hf_model(seq).logits[0, sl].float(), -1).gather(-1, toks).squeeze(-1)
            errs_engine.append((torch.tensor(c.logprobs, device="cuda") - lp32).abs())
            errs_hf.append((lp16 - lp32).abs())
    e, h = torch.cat(errs_engine), torch.cat(errs_hf)
    del ref32
    torch.cuda.empty_cache()
    emit({"check": "logprobs_vs_fp32_reference_0.5B", "engine_bf16_mean_abs": round(e.mean().item(), 5),
          "engine_bf16_max_abs": round(e.max().item(), 5), "hf_bf16_mean_abs": round(h.mean().item(), 5),
          "hf_bf16_max_abs": round(h.max().item(), 5), "tokens": e.numel(), **settings}, sink)


class guard:
    """Run one section; on failure record the error and carry on with the next section."""

    def __init__(self, name: str, sink: list):
        self.name, self.sink = name, sink

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            import traceback

            traceback.print_exception(exc_type, exc, tb)
            emit({"error": self.name, "exception": repr(exc)[:500]}, self.sink)
        return True


def profile_decode(hf_model, path: str) -> None:
    """Kernel-time table of an eager (no graphs) decode-heavy run: where a step's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(hf_model, cuda_graphs=False, max_num_seqs=256)
    prompts = prompts_of(16, [128] * 16, QWEN2_05B["vocab_size"], seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=8, ignore_eos=True, seed=0)
    engine.generate(prompts, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    engine.sleep(1)


def check_sleep_wake(engine, sink, settings) -> None:
    """sleep(2) frees weights + KV + graphs, wake_up restores them, greedy outputs are unchanged."""
    prompts = prompts_of(4, [100] * 4, QWEN2_05B["vocab_size"], seed=9)
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    before = [c.token_ids for c in engine.generate(prompts, params)]
    report = engine.memory_report()
    freed = engine.sleep(2)
    asleep = engine.memory_report()
    restored = engine.wake_up()
    after = [c.token_ids for c in engine.generate(prompts, params)]
    emit({"check": "sleep2_wake_roundtrip", "same_greedy_outputs": before == after, "freed": freed,
          "restored": restored, "report_before": report, "report_asleep": asleep, **settings}, sink)


def git_commit() -> str:
    try:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        return subprocess.check_output(["git", "-C", root, "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return os.environ.get("TIDAL_COMMIT", "unknown")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--cases", default="main,mixed,512,2048")
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    ap.add_argument("--no-graph-variant", action="store_true", help="also time main without CUDA graphs")
    ap.add_argument("--compare-graphs", action="store_true",
                    help="also time the cases above engine.cuda_graph_max_batch with their decode batch in a CUDA graph")
    ap.add_argument("--stop-ids", type=int, default=400)
    ap.add_argument("--profile", default="", help="write a kernel-time table of eager decode to this path")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rollout.jsonl"))
    args = ap.parse_args()
    sink: list[dict] = []
    base = {"commit": os.environ.get("TIDAL_COMMIT") or git_commit(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    bw = copy_bandwidth()
    emit({"figure": "copy_bandwidth_GBps", "value": round(bw / 1e9, 1), **base}, sink)
    if args.check:
        with guard("check_tiny_exact", sink):
            check_tiny_exact(sink, base)
    hf_model = make_hf_model()
    cases = args.cases.split(",")
    V = QWEN2_05B["vocab_size"]
    engine = make_engine(hf_model)
    if args.check:
        with guard("check_05b_logprobs", sink):
            check_05b_logprobs(hf_model, engine, sink, base)
        with guard("check_sleep_wake", sink):
            check_sleep_wake(engine, sink, base)
    if "main" in cases:
        prompts = prompts_of(16, [128] * 16, V, seed=1)
        params = SamplingParams(temperature=1.0, max_new_tokens=256, n=8, ignore_eos=True, seed=0)
        settings = {**base, "prompts": 16, "n": 8, "prompt_len": 128, "new_tokens": 256, "block_size": 16}
        with guard("main_native", sink):
            bench_native("main", engine, prompts, params, bw, "triton+cuda_graphs", sink, settings)
            step_breakdown(engine, 128, sink, base)
        with guard("main_no_overlap", sink):
            engine.sleep(1)
            plain = make_engine(hf_model, overlap_scheduling=False)
            bench_native("main", plain, prompts, params, bw, "triton+cuda_graphs,no_overlap", sink, settings)
            plain.sleep(1)
            del plain
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = make_engine(hf_model)
            bench_native("main", lt, prompts, params, bw, "triton+cuda_graphs,cublaslt", sink, settings)
            lt.sleep(1)
            del lt
            torch.backends.cuda.preferred_blas_library("default")
            torch.cuda.empty_cache()
            engine.wake_up()
        if args.no_graph_variant:
            with guard("main_eager", sink):
                engine.sleep(1)
                eager = make_engine(hf_model, cuda_graphs=False)
                bench_native("main", eager, prompts, params, bw, "triton_eager", sink, settings)
                eager.sleep(1)
                del eager
                torch.cuda.empty_cache()
                engine.wake_up()
        if args.hf_new_tokens > 0:
            with guard("main_hf", sink):
                engine.sleep(1)
                bench_hf(hf_model, prompts, 8, args.hf_new_tokens, sink, settings)
            torch.cuda.empty_cache()
            engine.wake_up()
    if "mixed" in cases or "partial" in cases:
        g = torch.Generator().manual_seed(3)
        lengths = torch.randint(64, 513, (32,), generator=g).tolist()
        prompts = prompts_of(32, lengths, V, seed=2)
        stop = tuple(range(V - args.stop_ids, V))
        params = SamplingParams(temperature=1.0, max_new_tokens=1024, n=8, stop_token_ids=stop, seed=0)
        settings = {**base, "prompts": 32, "n": 8, "prompt_len": "64-512", "new_tokens": "stop or 1024",
                    "stop_ids": len(stop)}
        if "mixed" in cases:
            with guard("mixed", sink):
                bench_native("mixed", engine, prompts, params, bw, "triton+cuda_graphs", sink, settings)
        if "partial" in cases:
            with guard("partial", sink):
                bench_partial(engine, prompts, params, 24, sink, settings)
    for seqs in (512, 2048):
        if str(seqs) not in cases:
            continue
        prompts = prompts_of(seqs // 8, [128] * (seqs // 8), V, seed=4)
        params = SamplingParams(temperature=1.0, max_new_tokens=256, n=8, ignore_eos=True, seed=0)
        settings = {**base, "prompts": seqs // 8, "n": 8, "prompt_len": 128, "new_tokens": 256}
        graphs = seqs <= engine.cfg.cuda_graph_max_batch
        with guard(str(seqs), sink):
            bench_native(str(seqs), engine, prompts, params, bw, "triton+cuda_graphs" if graphs else "triton,eager_decode",
                         sink, settings)
        if not graphs and args.compare_graphs:  # the same case with its decode batch in a CUDA graph
            with guard(f"{seqs}_graphs", sink):
                engine.sleep(1)
                captured = make_engine(hf_model, cuda_graph_max_batch=seqs)
                bench_native(str(seqs), captured, prompts, params, bw, "triton+cuda_graphs", sink, settings)
                emit({"case": str(seqs), "figure": "graph_pool_bytes", "bytes": captured.memory_report()["graphs"],
                      **base}, sink)
                captured.sleep(1)
                del captured
                torch.cuda.empty_cache()
                engine.wake_up()
    mem = engine.memory_report()
    emit({"figure": "engine_memory_bytes", **mem, "sleep1_freed": engine.sleep(1), **base}, sink)
    if args.profile:
        with guard("profile", sink):
            profile_decode(hf_model, args.profile)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for r in sink:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
