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


from tidal.config_base import check, to_dict
from tidal.logging.progress import Step, stage
from tidal.tasks.arithmetic import sft_rows, split_problems
from tidal.tasks.calculator import prepare_calculator
from tidal.tasks.config import TaskConfig
from tidal.tasks.model import build_model, model_config
from tidal.tasks.sft import build_threads, evaluate_greedy, kept_phase, supervised_finetune, whole_build
from tidal.tasks.store import MARKER, TaskAssets, asset_dir, built, write_jsonl
from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer


def prepare(cfg: TaskConfig, *, run_threads: int = 0) -> TaskAssets:
    """Return the task's assets, building them first unless a complete build exists, with
    ``task.sft_threads`` torch threads or, when 0, the run's (``run_threads``: ``run.cpu_threads``;
    :func:`tidal.tasks.sft.build_threads`)."""
    check(cfg.name != "", "name", "no built-in task selected (set task.name, e.g. 'arithmetic')")
    if cfg.name == "calculator":
        return prepare_calculator(cfg.calculator, workdir=cfg.workdir, threads=cfg.sft_threads, run_threads=run_threads)
    return built(cfg, cfg.workdir, lambda c, out, phases: _build(c, out, phases, run_threads))


def model_config_and_tokenizer(cfg: TaskConfig):
    """(the Hugging Face config, the tokenizer) of the task's model as a run loads them, without
    building the model (``tidal check``): read from a complete build, else made as the build makes
    them (the tokenizer trained in about a second, the config without weights)."""
    check(cfg.name != "", "name", "no built-in task selected (set task.name, e.g. 'arithmetic')")
    root = asset_dir(cfg.calculator if cfg.name == "calculator" else cfg, cfg.workdir)
    if (root / MARKER).is_file():
        from transformers import AutoConfig

        from tidal.models.loading import load_tokenizer

        return AutoConfig.from_pretrained(root / "model"), load_tokenizer(str(root / "model"))
    if cfg.name == "calculator":
        from tidal.tasks.calculator import model_config_and_tokenizer as calculator_config

        return calculator_config(cfg.calculator)
    tokenizer = _tokenizer(_problems(cfg)[0])
    return model_config(cfg, tokenizer, architecture=cfg.architecture), tokenizer


def _problems(cfg: TaskConfig) -> tuple[list, list]:
    return split_problems(digits=cfg.digits, operations=cfg.operations, num_train=cfg.num_train, num_eval=cfg.num_eval,
                          seed=cfg.seed, fixed_width=cfg.fixed_width)


def _tokenizer(train: list):
    return train_tokenizer(p.prompt + " " + p.format(p.answer) for p in train)


def _build(cfg: TaskConfig, out: Path, phases: Path, run_threads: int) -> None:
    start = time.perf_counter()
    train, held_out = _problems(cfg)
    eval_rows = [p.row() for p in held_out]
    write_jsonl(out / "train.jsonl", [p.row() for p in train])
    write_jsonl(out / "eval.jsonl", eval_rows)
    with whole_build(cfg.name, cfg.sft_steps + cfg.sft_mistake_steps) as whole:
        with stage(f"training the '{cfg.name}' task's tokenizer"):
            tokenizer = _tokenizer(train)
        with build_threads(cfg.sft_threads, run_threads):
            model = build_model(cfg, tokenizer, architecture=cfg.architecture)
            report = _warm_start(cfg, model, tokenizer, train, eval_rows, whole, phases)
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


def _warm_start(cfg: TaskConfig, model, tokenizer, train: list, eval_rows: list[dict], whole: Step, phases: Path) -> dict:
    """Phase 1 teaches the procedure on correct demonstrations (kept once finished, for a stopped
    build: :func:`tidal.tasks.sft.kept_phase`); phase 2 teaches the slip habit on demonstrations of
    which ``sft_mistake_rate`` are slipped. Returns losses and accuracies."""
    sft = dict(lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, whole=whole)

    def phase_1() -> dict:
        clean = supervised_finetune(model, tokenizer, sft_rows(train, mistake_rate=0.0, seed=cfg.seed), steps=cfg.sft_steps,
                                    seed=cfg.seed, description="warm start 1/2 (SFT on correct demonstrations)", **sft)
        return {"sft_loss": clean[-1] if clean else float("nan"), "clean_accuracy": _held_out_accuracy(model, tokenizer, eval_rows)}

    first = kept_phase(phases, "1", model, phase_1, steps=cfg.sft_steps, whole=whole)
    mistake_rows = sft_rows(train, mistake_rate=cfg.sft_mistake_rate, seed=cfg.seed + 1)
    slipped = supervised_finetune(model, tokenizer, mistake_rows, steps=cfg.sft_mistake_steps, seed=cfg.seed + 1,
                                  description=f"warm start 2/2 (SFT, {cfg.sft_mistake_rate:.0%} slipped demonstrations)", **sft)
    return {
        **first,
        "mistake_loss": slipped[-1] if slipped else float("nan"),
        "sft_accuracy": _held_out_accuracy(model, tokenizer, eval_rows) if slipped else first["clean_accuracy"],
    }


def _held_out_accuracy(model, tokenizer, eval_rows: list[dict]) -> float:
    with stage(f"greedy accuracy on {len(eval_rows)} held-out problems") as shown:
        accuracy = evaluate_greedy(model, tokenizer, eval_rows)
        shown.done(f"{accuracy:.3f}")
    return accuracy
