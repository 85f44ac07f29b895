"""Padded against packed update phases on one GPU: time, model FLOPs utilisation, peak memory, the
forward/backward/optimizer split, compile time and recompiles (issue 21, items 1, 4 and 5).

The workload is an update of a randomly initialised Qwen2-shaped model (no download) over one
rollout's worth of sequences: ``--seqs`` rows of ``--prompt`` prompt tokens and a response length
drawn per row (``--lengths lognormal``: heavy-tailed, median about a quarter of ``--max-new``, capped
at it; ``forced``: all ``--max-new``). Each mode (``padded``: today's sorted token-budget batches of
right-padded rows; ``packed``: first-fit-decreasing real-token micro-batches run padding-free) runs
``--steps`` iterations of an experience forward (no grad, the forward budget) and an update
(forward + backward over every micro-batch and one optimizer step), under
FSDP2 with ``strategy.compile`` as given. The first iteration pays compilation; the others are the
steady state. One JSON line per iteration and one summary line per mode go to stdout (and
``--out``). MFU counts real tokens only (:mod:`tidal.models.flops`) against the measured bf16
matmul ceiling.

    python bench/packed_update.py --size 0.5b --seqs 256 --prompt 256 --max-new 1024 --steps 4
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time

import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.logging.compile import CompileMonitor
from tidal.logging.update_split import UpdateSplit, train_perf
from tidal.logging.memory_peaks import DevicePeaks
from tidal.models.flops import FlopModel, measure_matmul_peak, mfu
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.varlen import enable_packed_attention
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy
from tidal.trainer.experience import packed_micro_batches, token_budget_batches

SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960),
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008),
}


def rollout(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if args.lengths == "forced":
        resp = [args.max_new] * args.seqs
    else:
        draw = torch.empty(args.seqs).log_normal_(math.log(args.max_new / 4), 0.9, generator=g)
        resp = [max(1, min(args.max_new, int(x))) for x in draw]
    lens = [args.prompt + r for r in resp]
    T = max(lens)
    ids = torch.randint(0, 1000, (args.seqs, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lens)[:, None]).long()
    act = (am.bool() & (torch.arange(T)[None] >= args.prompt)).float()
    return ids * am, am, act


def one_step(mode, state, strategy, data, args, split) -> dict:
    ids, am, act = data
    lengths = am.sum(-1).tolist()
    if mode == "packed":
        batches = packed_micro_batches(lengths, args.micro_batch_tokens, args.micro_batch_max_seqs)
    else:
        batches = token_budget_batches(lengths, args.micro_batch_tokens, args.micro_batch_max_seqs)
    n_act = float(act.sum())
    padded_tokens = 0
    for i, rows in enumerate(batches):
        T = max(lengths[r] for r in rows)
        b_ids, b_am, b_act = ids[rows, :T], am[rows, :T], act[rows, :T]
        if mode == "packed":
            pb = PackedBatch.build(b_ids, b_am, targets_BT=b_act, cap=args.micro_batch_tokens)
            kw = {"packed": pb.to(strategy.device)}
            padded_tokens += pb.num_tokens  # the tokens the layers compute on (real + the bucket's dummy)
        else:
            kw = {"positions_BT": b_act.to(strategy.device)}
            padded_tokens += len(rows) * T
        b_ids, b_am, b_act = b_ids.to(strategy.device), b_am.to(strategy.device), b_act.to(strategy.device)
        with split.part("forward"):
            logp, _ = token_logprobs(state.model, b_ids, b_am, with_entropy=True, entropy_grad=False, **kw)
            loss = -(logp * b_act).sum() / n_act
        with split.part("backward"):
            strategy.backward(loss, state, sync_grads=i == len(batches) - 1)
    with split.part("optimizer"):
        strategy.optimizer_step(state)
    return {"micro_batches": len(batches), "padded_tokens": padded_tokens}


@torch.no_grad()
def forward_pass(mode, state, strategy, data, args) -> None:
    """The experience forward (old logprobs, no grad) over every row with the forward budget."""
    ids, am, act = data
    lengths = am.sum(-1).tolist()
    plan = packed_micro_batches if mode == "packed" else token_budget_batches
    for rows in plan(lengths, args.forward_micro_batch_tokens, args.forward_micro_batch_max_seqs):
        T = max(lengths[r] for r in rows)
        b_ids, b_am, b_act = ids[rows, :T], am[rows, :T], act[rows, :T]
        kw = {"packed": PackedBatch.build(b_ids, b_am, targets_BT=b_act, cap=args.forward_micro_batch_tokens).to(strategy.device)} \
            if mode == "packed" else {"positions_BT": b_act.to(strategy.device)}
        token_logprobs(state.model, b_ids.to(strategy.device), b_am.to(strategy.device), **kw)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode, base, strategy, data, args, fm, peak) -> list[dict]:
    model = copy.deepcopy(base)
    if mode == "packed":
        enable_packed_attention(model)
    attach_logprob_method(model)
    state = strategy.prepare_trainable(model, OptimConfig(lr=1e-6), lr=1e-6, total_steps=args.steps)
    split = UpdateSplit(strategy.device)
    lens = data[1].sum(-1).tolist()
    head_tokens = int(data[2].sum())  # the forward pass's LM head runs on response tokens only
    flops = fm.train_flops(lens)
    rows = []
    peaks = DevicePeaks(strategy.device)  # the allocator's peak counter has one owner (nothing else resets it)
    torch._dynamo.reset()
    with CompileMonitor(lambda m: print(m, flush=True)) as mon:
        for step in range(args.steps):
            _sync(strategy.device)
            with peaks.scope("step") as step_peak:
                t0 = time.perf_counter()
                forward_pass(mode, state, strategy, data, args)
                _sync(strategy.device)
                t1 = time.perf_counter()
                info = one_step(mode, state, strategy, data, args, split)
                _sync(strategy.device)
                seconds = time.perf_counter() - t1
            row = {"mode": mode, "step": step, "seconds": seconds, **info, "real_tokens": sum(lens),
                   **train_perf(flops, seconds, peak), "forward_s": t1 - t0,
                   "forward_mfu": mfu(fm.forward_flops(lens, head_tokens=head_tokens), t1 - t0, peak),
                   "peak_gib": step_peak.allocated / 2**30, **split.pop(), **mon.pop()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    del state, model
    if strategy.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--lengths", choices=["lognormal", "forced"], default="lognormal")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--micro-batch-max-seqs", type=int, default=64)
    ap.add_argument("--forward-micro-batch-tokens", type=int, default=65536)
    ap.add_argument("--forward-micro-batch-max-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compile", choices=["on", "off"], default="on")
    ap.add_argument("--modes", default="padded,packed")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    rt = init_runtime(1, args.device)
    cfg = Qwen2Config(**SIZES[args.size], vocab_size=151936, tie_word_embeddings=args.size == "0.5b")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg)
    strategy = get_strategy(StrategyConfig(compile=args.compile), rt)
    peak = measure_matmul_peak(rt.device) if rt.device.type == "cuda" else measure_matmul_peak(rt.device, torch.float32, n=256)
    fm = FlopModel.from_config(cfg)
    data = rollout(args)
    summary = []
    for mode in args.modes.split(","):
        rows = run_mode(mode, base, strategy, data, args, fm, peak)
        steady = rows[1:] or rows
        summary.append({
            "summary": mode, "size": args.size, "lengths": args.lengths, "seqs": args.seqs,
            "first_iteration_s": rows[0]["forward_s"] + rows[0]["seconds"], "compile_s": rows[0]["time/compile"],
            "steady_s": statistics.median(r["seconds"] for r in steady), "mfu": statistics.median(r["perf/mfu"] for r in steady),
            "forward_s": statistics.median(r["forward_s"] for r in steady), "forward_mfu": statistics.median(r["forward_mfu"] for r in steady),
            "peak_gib": max(r["peak_gib"] for r in rows), "recompiles": rows[-1]["compile/recompiles"],
            "micro_batches": rows[-1]["micro_batches"], "real_tokens": rows[-1]["real_tokens"],
            "padded_tokens": rows[-1]["padded_tokens"], "bf16_peak_tflops": peak / 1e12,
            **{k: statistics.median(r[k] for r in steady) for k in ("perf/forward_s", "perf/backward_s", "perf/optimizer_s")},
        })
        print(json.dumps(summary[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for s in summary:
                f.write(json.dumps(s) + "\n")
    shutdown()


if __name__ == "__main__":
    main()
