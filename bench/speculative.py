"""Speculative rollouts (issue 31) on one GPU. Prints one JSON line per figure and appends them to
``--out`` (default ``bench/results/speculative.jsonl``) with the commit, device and settings.

Parts (``--parts``):
- ``graphs``: CUDA graphs and Triton kernels on verify shapes: tiny fp32 Qwen2, greedy tokens with
  ``engine.speculative=on`` (oracle drafts that always / partly match) equal those with ``off``;
  sampled runs (temperature 1, fused in-graph sampler on plain rows) complete with equal lengths.
- ``overhead``: random-weight Qwen2-0.5B shape (bf16), where drafts are (almost) never accepted:
  wall time with ``auto`` against ``off`` on long-tail shapes (prompts x samples, geometric lengths
  through ``--stop-ids`` stop tokens, capped), temperature 1.
- ``structured``: speed-up on a model whose samples repeat structure. The 0.5B shape is trained on
  the device for ``--train-steps`` AdamW steps on synthetic worked solutions (a word-level template
  of arithmetic word problems, :func:`worked_solution`), then rolled out at temperature 1 with 16
  samples per prompt, ``off`` against ``auto`` and ``on``: tokens/s, acceptance, accepted tokens
  per verify, and the time of the last 10% of sequences. How the model was made is in the record.

CUDA graphs are captured on first use per row count; each mode runs on a fresh engine, warmed by
two rollouts before the timed one, but a verify step can still meet a row count not seen before
(its capture then falls inside the timed rollout). Results of commit ebfcc3b and earlier were
warmed by one rollout only.

Usage: python bench/speculative.py [--parts graphs,overhead,structured] [--out PATH] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tidal.engine.base import Request, SamplingParams  # noqa: E402
from tidal.engine.config import EngineConfig  # noqa: E402
from tidal.engine.native import NativeEngine  # noqa: E402
from tidal.engine.native.speculative import STAT_KEYS  # noqa: E402
from tidal.engine.native.speculative.metrics import rollout_metrics  # noqa: E402

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                 tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)


def emit(record: dict, meta: dict, sink: list) -> None:
    record = {**record, **meta}
    print(json.dumps(record), flush=True)
    sink.append(record)


def sync(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def build(shape: dict, device, dtype, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(dtype)
    return model


def engine_of(model, device, dtype, mode: str, **cfg) -> NativeEngine:
    eng = NativeEngine(model.config, EngineConfig(speculative=mode, **cfg), device=device, dtype=dtype)
    eng.load_weights((k, v.detach()) for k, v in model.state_dict().items())
    return eng


def rollout(eng: NativeEngine, prompts, params: SamplingParams, device) -> dict:
    """Add ``params.n`` requests per prompt, step to the end; wall time, tokens and the time of the
    last 10% of sequences (from the moment 90% had finished)."""
    one = dataclasses.replace(params, n=1)
    reqs = [Request(request_id=i * params.n + j, prompt_ids=p, params=one, group_id=i)
            for i, p in enumerate(prompts) for j in range(params.n)]
    before = dict(eng.stats)
    t0 = sync(device)
    eng.add(reqs)
    done, stamps = [], []
    while eng.has_unfinished():
        out = eng.step()
        if out:
            now = time.perf_counter()
            done += out
            stamps += [now] * len(out)
    t1 = sync(device)
    k90 = max(0, int(0.9 * len(stamps)) - 1)
    tokens = sum(len(c.token_ids) for c in done)
    spec = rollout_metrics(before, eng.stats)
    return {"wall_s": round(t1 - t0, 4), "tokens": tokens, "tokens_per_s": round(tokens / (t1 - t0), 1),
            "tail10_s": round(t1 - stamps[k90], 4), "decode_steps": eng.stats["decode_steps"] - before["decode_steps"],
            **{k[len("rollout/"):]: round(v, 4) for k, v in spec.items()},
            "counts": {k: eng.stats[k] - before[k] for k in STAT_KEYS}}, done


# ---- graphs -------------------------------------------------------------------------------------
def part_graphs(args, meta, sink, device):
    from tests.engine.helpers import OracleDrafter

    model = build(TINY, device, torch.float32)
    prompts = [[random.Random(i).randrange(1000) for _ in range(5 + 7 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True, n=2)
    off = engine_of(model, device, torch.float32, "off").generate(prompts, greedy)
    refs = {tuple(p): off[2 * i].token_ids for i, p in enumerate(prompts)}
    for mode in ("always", "partly"):
        eng = engine_of(model, device, torch.float32, "on")
        eng.spec.index = OracleDrafter(refs, mode, TINY["vocab_size"], skip=lambda s: s % 3 == 2)
        got = eng.generate(prompts, greedy)
        same = [c.token_ids for c in got] == [c.token_ids for c in off]
        lp = max(abs(a - b) for g, w in zip(got, off) for a, b in zip(g.logprobs, w.logprobs))
        emit({"part": "graphs", "drafts": mode, "greedy_equal": same, "max_logprob_diff": lp,
              "graphs_captured": sorted(str(k) for k in eng.runner.graphs.graphs) if eng.runner.graphs else None,
              "counts": {k: eng.stats[k] for k in STAT_KEYS}}, meta, sink)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, n=4, seed=1)
    eng = engine_of(model, device, torch.float32, "on")
    eng.generate(prompts, sampled)
    got = eng.generate(prompts, dataclasses.replace(sampled, seed=2))
    emit({"part": "graphs", "drafts": "index", "sampled_lengths_ok": all(len(c.token_ids) == 48 for c in got),
          "counts": {k: eng.stats[k] for k in STAT_KEYS}}, meta, sink)


# ---- overhead -----------------------------------------------------------------------------------
def part_overhead(args, meta, sink, device):
    model = build(QWEN2_05B, device, torch.bfloat16)
    V = QWEN2_05B["vocab_size"]
    stops = tuple(range(V - args.stop_ids, V))
    cases = [("tail_8x8", 8, 8, 128, 1024), ("tail_32x8", 32, 8, 256, 1024), ("tail_2x4", 2, 4, 512, 512)]
    for name, n_prompts, n, plen, cap in cases:
        rng = random.Random(0)
        prompts = [[rng.randrange(V - args.stop_ids) for _ in range(plen)] for _ in range(n_prompts)]
        params = SamplingParams(temperature=1.0, max_new_tokens=cap, n=n, seed=0, stop_token_ids=stops)
        for mode in ("off", "auto", "off", "auto"):  # twice each: the second pair is reported
            eng = engine_of(model, device, torch.bfloat16, mode, kv_cache_memory_fraction=0.3)
            rec, _ = rollout(eng, prompts, params, device)
            rec.update(part="overhead", case=name, mode=mode, prompts=n_prompts, n=n, prompt_len=plen,
                       max_new_tokens=cap, stop_ids=args.stop_ids, weights="random")
            emit(rec, meta, sink)
            del eng
            torch.cuda.empty_cache() if device.type == "cuda" else None


# ---- structured ---------------------------------------------------------------------------------
NAMES = ["Tom", "Ann", "Sam", "Lia", "Max", "Eva", "Ben", "Zoe"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "eggs"]


def worked_solution(rng: random.Random) -> tuple[str, str]:
    """One synthetic GSM8K-format problem and its worked solution (word-level, digits split)."""
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randrange(2, 60), rng.randrange(2, 40), rng.randrange(2, 9)
    q = f"Question : {who} has {a} {item} . {who} buys {b} more {item} and then gets {c} times as many . How many {item} does {who} have ?"
    s, m = a + b, (a + b) * c
    sol = (f"Answer : {who} starts with {a} {item} . After buying {b} more , {who} has {a} + {b} = {s} {item} . "
           f"Then {who} gets {c} times as many , so {who} has {s} * {c} = {m} {item} . The answer is {m} . #### {m}")
    split = lambda t: " ".join(" ".join(w) if w.isdigit() else w for w in t.split())  # noqa: E731
    return split(q), split(sol)


class WordVocab:
    def __init__(self, V: int):
        self.ids: dict[str, int] = {}
        self.V = V

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(w, 10 + len(self.ids)) for w in text.split()]


def train_structured(args, device, vocab: WordVocab):
    """The 0.5B shape trained from random init on worked solutions (next-token loss on whole texts)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = QWEN2_05B if device.type == "cuda" else TINY
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(1)
    eos = 2
    losses, t0 = [], time.perf_counter()
    for step in range(args.train_steps):
        rows = []
        for _ in range(args.train_batch):
            q, s = worked_solution(rng)
            rows.append(vocab.encode(q) + vocab.encode(s) + [eos])
        L = max(len(r) for r in rows)
        ids = torch.tensor([r + [eos] * (L - len(r)) for r in rows], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    model.config.eos_token_id = eos
    return model.to(torch.bfloat16 if device.type == "cuda" else torch.float32), losses, time.perf_counter() - t0


def part_structured(args, meta, sink, device):
    vocab = WordVocab(QWEN2_05B["vocab_size"])
    model, losses, train_s = train_structured(args, device, vocab)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = random.Random(7)
    all_prompts = [vocab.encode(worked_solution(rng)[0]) for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=200, n=16, seed=3)
    made = {"model": "qwen2-0.5b shape, random init, trained on device", "train_steps": args.train_steps,
            "train_batch": args.train_batch, "lr": args.lr, "train_s": round(train_s, 1),
            "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
            "data": "bench/speculative.py worked_solution (word-level GSM8K-format template, digits split)"}
    emit({"part": "structured", "figure": "model", **made}, meta, sink)
    for num_prompts in (len(all_prompts), 2):
        prompts = all_prompts[:num_prompts]
        for mode in ("off", "auto", "on", "off", "auto", "on"):  # twice each: the second three are reported
            eng = engine_of(model, device, dtype, mode, kv_cache_memory_fraction=0.3)
            eng.eos_token_ids = {2}
            for seed in (3, 5):  # warm-up: graphs of the row counts met, and earlier epochs in the index
                eng.generate(prompts, dataclasses.replace(params, seed=seed))
            rec, done = rollout(eng, prompts, dataclasses.replace(params, seed=4), device)
            rec.update(part="structured", mode=mode, prompts=len(prompts), n=16, temperature=1.0, max_new_tokens=200,
                       index_warm="two earlier rollouts of the same prompts",
                       mean_len=round(sum(len(c.token_ids) for c in done) / len(done), 1))
            emit(rec, meta, sink)
            del eng


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="graphs,overhead,structured")
    ap.add_argument("--out", default="bench/results/speculative.jsonl")
    ap.add_argument("--stop-ids", type=int, default=400)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (checks the script runs)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        QWEN2_05B.update(TINY)
        args.train_steps, args.train_batch, args.prompts = 5, 4, 2
    commit = os.environ.get("TIDAL_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                              text=True).stdout.strip()
    meta = {"commit": commit, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "host": platform.node()[:16], "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    sink: list = []
    parts = {"graphs": part_graphs, "overhead": part_overhead, "structured": part_structured}
    try:
        for name in args.parts.split(","):
            parts[name](args, meta, sink, device)
    finally:
        if args.out and sink:
            with open(args.out, "a") as f:
                for r in sink:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
