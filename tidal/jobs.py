"""Jobs: what one ``tidal train`` runs, chosen by the root key ``job``.

- ``rl`` (default): colocated RL fine-tuning (:mod:`tidal.trainer`); reads every section except
  ``reward_model``.
- ``reward_model``: Bradley-Terry reward-model training on preference pairs (:mod:`tidal.rm`).

Every job runs through the same config system and entry point (``tidal train CONFIG`` under
``torchrun``, either Strategy). A job reads only some keys of the shared sections; a key it does
not read must keep its default, so a setting never silently does nothing: :func:`check_job_keys`
raises a ConfigError naming the first such key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.config_base import ConfigError

# Keys (a whole section or one of its keys) read by the reward-model job; every other key keeps its default.
REWARD_MODEL_READS = (
    "run", "reward_model", "checkpoint",
    "model.path", "model.tokenizer_path", "model.gradient_checkpointing",
    "data.train", "data.eval", "data.prompt_key", "data.messages_key", "data.system_prompt", "data.apply_chat_template",
    "data.shuffle",
    "strategy.backend", "strategy.param_dtype", "strategy.reshard_after_forward", "strategy.offload_optimizer",
    "strategy.zero_stage", "strategy.compile",
    "optim.lr", "optim.weight_decay", "optim.betas", "optim.eps", "optim.warmup_steps", "optim.scheduler",
    "optim.min_lr_ratio", "optim.max_grad_norm",
    "train.micro_batch_tokens", "train.micro_batch_max_seqs", "train.forward_micro_batch_tokens",
    "train.forward_micro_batch_max_seqs", "train.max_skipped_steps_in_a_row",
    "eval.every", "eval.at_start", "eval.at_end", "eval.max_prompts",
    "logging.backends", "logging.wandb_project", "logging.wandb_mode", "logging.log_every",
)
# What to use instead, for keys a reward-model run is likely to set by habit.
REWARD_MODEL_HINTS = {
    "data.max_prompt_len": "the reward-model job limits whole sequences: set reward_model.max_length",
    "data.overlong_prompt": "set reward_model.overlong",
    "task": "the reward-model job's built-in task is reward_model.task",
    "train.epochs": "run.steps counts optimizer steps of reward_model.batch_pairs pairs",
    "train.mini_batches": "one optimizer step takes reward_model.batch_pairs pairs",
    "rollout.prompts_per_step": "one optimizer step takes reward_model.batch_pairs pairs",
    "model.lora": "LoRA reward models are not supported yet",
}


def _covered(key: str, reads: tuple[str, ...]) -> bool:
    return any(key == r or key.startswith(r + ".") for r in reads)


def _first_changed(value: Any, default: Any, key: str, reads: tuple[str, ...]) -> str | None:
    """The first key under ``key`` (depth first) that is not read and differs from its default."""
    if _covered(key, reads):
        return None
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.init and (found := _first_changed(getattr(value, f.name), getattr(default, f.name), f"{key}.{f.name}", reads)):
                return found
        return None
    return key if value != default else None


def _hint(key: str, hints: dict[str, str]) -> str:
    for prefix, text in hints.items():
        if key == prefix or key.startswith(prefix + "."):
            return f"; {text}"
    return ""


def check_job_keys(cfg) -> None:
    """ConfigError at the first key that ``cfg.job`` does not read but that is set away from its
    default (``cfg`` is the root ``TidalConfig``; the root fields are compared with their defaults)."""
    if cfg.job == "rl":
        sections, reads, hints = ["reward_model"], (), {}
        why = "is read only by job=reward_model; remove it or set job: reward_model"
    else:
        sections = [f.name for f in dataclasses.fields(cfg) if f.init and f.name != "job"]
        reads, hints = REWARD_MODEL_READS, REWARD_MODEL_HINTS
        why = "is not read by job=reward_model; remove it"
    for f in dataclasses.fields(cfg):
        if f.name in sections and (key := _first_changed(getattr(cfg, f.name), f.default_factory(), f.name, reads)):
            raise ConfigError(key, why + _hint(key, hints))


def check_job(cfg) -> None:
    """The checks of ``cfg.job`` that span sections (after :func:`check_job_keys`)."""
    check_job_keys(cfg)
    if cfg.job == "reward_model":
        from tidal.rm.config import check_reward_model_job

        check_reward_model_job(cfg)


def check_job_world(cfg, world_size: int) -> None:
    """World-size checks of a job other than ``rl`` (whose own are in ``TidalConfig.check_world``)."""
    if cfg.job == "reward_model":
        from tidal.rm.config import check_reward_model_world

        check_reward_model_world(cfg, world_size)


def run_job(cfg, command: str, *, checkpoint: str | None = None, out: str | None = None, dtype: str | None = None) -> int:
    """``tidal train|eval|export`` of a job other than ``rl`` (the CLI has loaded ``cfg``, with
    ``checkpoint.resume`` set to ``checkpoint`` for eval and export; ``dtype`` is export's ``--dtype``)."""
    if cfg.job == "reward_model":
        from tidal.rm.cli import run

        return run(cfg, command, checkpoint=checkpoint, out=out, dtype=dtype)
    raise ValueError(f"job {cfg.job!r} has no runner")
