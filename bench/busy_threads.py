"""SFT steps/s of the quickstart's warm start while other processes keep every core busy (issue 44
item 11): each thread count, with torch's OpenMP threads spinning (libgomp's default) and sleeping
(``OMP_WAIT_POLICY=PASSIVE``, what importing Tidal sets), each measurement in a fresh process
(libgomp reads the policy once, when torch loads).

    python -m bench.busy_threads [--steps 40] [--threads 1 2] [--busy N]   # N: busy processes (default: one per core)

Prints one JSON line per case. A timing, not a test: on a shared machine the ratio swings, so the
suite checks the settings (tests/unit/test_task_build.py) and this measures their effect.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _busy(stop) -> None:
    while not stop.is_set():
        pass


def measure(threads: int, steps: int, busy: int) -> float:
    """SFT steps/s of the shipped quickstart task's model and batch, with ``busy`` busy-loop processes."""
    import torch

    from tidal.tasks.arithmetic import sft_rows, split_problems
    from tidal.tasks.config import TaskConfig
    from tidal.tasks.model import build_model
    from tidal.tasks.sft import supervised_finetune
    from tidal.tasks.tokenizer import train_tokenizer

    cfg = TaskConfig(name="arithmetic")
    train, _ = split_problems(digits=cfg.digits, operations=cfg.operations, num_train=cfg.num_train, num_eval=cfg.num_eval,
                              seed=cfg.seed, fixed_width=cfg.fixed_width)
    tokenizer = train_tokenizer(p.prompt + " " + p.format(p.answer) for p in train)
    torch.set_num_threads(threads)
    model = build_model(cfg, tokenizer)
    rows = sft_rows(train, mistake_rate=0.0, seed=cfg.seed)
    stop = mp.Event()
    loops = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(busy)]
    for p in loops:
        p.start()
    try:
        start = time.perf_counter()
        supervised_finetune(model, tokenizer, rows, steps=steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, seed=cfg.seed)
        return steps / (time.perf_counter() - start)
    finally:
        stop.set()
        for p in loops:
            p.join()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--busy", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--one", nargs=2, type=int, metavar=("THREADS", "STEPS"), help=argparse.SUPPRESS)  # a measuring child
    args = ap.parse_args(argv)
    if args.one:
        print(measure(args.one[0], args.one[1], args.busy))
        return
    for threads in args.threads:
        for policy in ("ACTIVE", "PASSIVE"):
            cmd = [sys.executable, "-m", "bench.busy_threads", "--one", str(threads), str(args.steps), "--busy", str(args.busy)]
            out = subprocess.run(cmd, env=dict(os.environ, OMP_WAIT_POLICY=policy), capture_output=True, text=True, check=True).stdout
            print(json.dumps({"threads": threads, "omp_wait_policy": policy, "busy_processes": args.busy,
                              "sft_steps_per_s": round(float(out.split()[-1]), 2)}), flush=True)


if __name__ == "__main__":
    main()
