"""Build (once) the assets of a built-in task: train/eval JSONL, tokenizer and warm-started model.

Layout under ``{workdir}/{name}-{hash of the settings}/``::

    model/        tokenizer + model of task.architecture (safetensors), loadable with from_pretrained
    train.jsonl   {"prompt", "reference", "label"} rows
    eval.jsonl    held-out rows, disjoint from train
    task.json     completion marker: the settings and SFT results (written last)

Where the folder lives and how it is built atomically: :mod:`tidal.tasks.store`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tidal.config_base import check, to_dict
from tidal.logging.progress import stage
from tidal.tasks.arithmetic import sft_rows, split_problems
from tidal.tasks.calculator import prepare_calculator
from tidal.tasks.config import TaskConfig
from tidal.tasks.model import build_model
from tidal.tasks.sft import evaluate_greedy, supervised_finetune
from tidal.tasks.store import MARKER, TaskAssets, built, write_jsonl
from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer


def prepare(cfg: TaskConfig) -> TaskAssets:
    """Return the task's assets, building them first unless a complete build exists."""
    check(cfg.name != "", "name", "no built-in task selected (set task.name, e.g. 'arithmetic')")
    if cfg.name == "calculator":
        return prepare_calculator(cfg.calculator, workdir=cfg.workdir, threads=cfg.sft_threads)
    return built(cfg, cfg.workdir, lambda c, out: _build(c, out))


def _build(cfg: TaskConfig, out: Path) -> None:
    start = time.perf_counter()
    train, held_out = split_problems(
        digits=cfg.digits, operations=cfg.operations, num_train=cfg.num_train, num_eval=cfg.num_eval,
        seed=cfg.seed, fixed_width=cfg.fixed_width,
    )
    eval_rows = [p.row() for p in held_out]
    write_jsonl(out / "train.jsonl", [p.row() for p in train])
    write_jsonl(out / "eval.jsonl", eval_rows)
    with stage(f"training the '{cfg.name}' task's tokenizer"):
        tokenizer = train_tokenizer(p.prompt + " " + p.format(p.answer) for p in train)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.sft_threads)
    try:
        model = build_model(cfg, tokenizer, architecture=cfg.architecture)
        report = _warm_start(cfg, model, tokenizer, train, eval_rows)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out / "model")
    save_tokenizer(tokenizer, str(out / "model"))
    report["build_seconds"] = time.perf_counter() - start
    print(
        f"[tidal.tasks] built '{cfg.name}' in {report['build_seconds']:.1f}s ({sum(p.numel() for p in model.parameters())} params): "
        f"{cfg.sft_steps} SFT steps (loss {report['sft_loss']:.3f}, held-out greedy accuracy {report['clean_accuracy']:.3f}), "
        f"then {cfg.sft_mistake_steps} steps with {cfg.sft_mistake_rate:.0%} slipped demonstrations (loss {report['mistake_loss']:.3f}): "
        f"held-out greedy accuracy {report['sft_accuracy']:.3f}",
        flush=True,
    )
    (out / MARKER).write_text(json.dumps({"settings": to_dict(cfg), **report}, indent=2))


def _warm_start(cfg: TaskConfig, model, tokenizer, train: list, eval_rows: list[dict]) -> dict:
    """Phase 1 teaches the procedure on correct demonstrations; phase 2 teaches the slip habit on
    demonstrations of which ``sft_mistake_rate`` are slipped. Returns losses and accuracies."""
    sft = dict(lr=cfg.sft_lr, batch_size=cfg.sft_batch_size)
    clean = supervised_finetune(model, tokenizer, sft_rows(train, mistake_rate=0.0, seed=cfg.seed), steps=cfg.sft_steps,
                                seed=cfg.seed, description="warm start 1/2 (SFT on correct demonstrations)", **sft)
    clean_accuracy = _held_out_accuracy(model, tokenizer, eval_rows)
    mistake_rows = sft_rows(train, mistake_rate=cfg.sft_mistake_rate, seed=cfg.seed + 1)
    slipped = supervised_finetune(model, tokenizer, mistake_rows, steps=cfg.sft_mistake_steps, seed=cfg.seed + 1,
                                  description=f"warm start 2/2 (SFT, {cfg.sft_mistake_rate:.0%} slipped demonstrations)", **sft)
    return {
        "sft_loss": clean[-1] if clean else float("nan"),
        "clean_accuracy": clean_accuracy,
        "mistake_loss": slipped[-1] if slipped else float("nan"),
        "sft_accuracy": _held_out_accuracy(model, tokenizer, eval_rows) if slipped else clean_accuracy,
    }


def _held_out_accuracy(model, tokenizer, eval_rows: list[dict]) -> float:
    with stage(f"greedy accuracy on {len(eval_rows)} held-out problems") as shown:
        accuracy = evaluate_greedy(model, tokenizer, eval_rows)
        shown.done(f"{accuracy:.3f}")
    return accuracy
