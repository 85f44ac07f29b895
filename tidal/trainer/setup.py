"""Wiring a run from its config: runtime, strategy, models, engine, rewards, data, logging.

Each function builds one thing; ``build_trainer`` only calls them in order (spec §7 "initialise":
ranks and process groups, wrapped models, engine, first weight sync, engine to sleep).
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import numpy as np
import torch

from tidal.algorithms import Algorithm
from tidal.config import TidalConfig
from tidal.config_base import check
from tidal.data import DataSource, PromptDataset, StatefulDistributedSampler
from tidal.data.prompts import require_chat_template
from tidal.distributed import Runtime, init_runtime
from tidal.engine.factory import create_engine, engine_dtype
from tidal.logging import MetricsLogger
from tidal.models import load_causal_lm, load_critic, load_tokenizer
from tidal.models.lora import adapter_disabled_reference, apply_lora
from tidal.rewards import RewardEngine
from tidal.strategy import get_strategy
from tidal.trainer import checkpoint as ckpt
from tidal.trainer.ppo_trainer import PPOTrainer
from tidal.trainer.watchdog import StageTimer, Watchdog


@dataclasses.dataclass(kw_only=True)
class ResolvedPaths:
    """Where the model and data come from: the config's paths, or a built-in task's assets."""

    model: str
    tokenizer: str
    critic: str
    reference: str
    train: list[DataSource]
    eval: list[DataSource]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_paths(cfg: TidalConfig, runtime: Runtime) -> ResolvedPaths:
    """Build the task's assets on rank 0 (others wait) when ``task.name`` is set."""
    m = cfg.model
    if not cfg.task.name:
        return ResolvedPaths(
            model=m.path, tokenizer=m.tokenizer_path or m.path, critic=m.critic_path or m.path,
            reference=m.reference_path or m.path, train=list(cfg.data.train), eval=list(cfg.data.eval),
        )
    from tidal.tasks import prepare

    if runtime.is_main:
        prepare(cfg.task)
    torch.distributed.barrier()
    assets = prepare(cfg.task)  # idempotent: returns the paths of what rank 0 built
    return ResolvedPaths(
        model=assets.model_path, tokenizer=assets.model_path, critic=assets.model_path, reference=assets.model_path,
        train=[DataSource(path=assets.train_path)], eval=[DataSource(path=assets.eval_path)],
    )


def total_optimizer_steps(cfg: TidalConfig) -> int:
    return cfg.run.steps * cfg.train.epochs * cfg.train.mini_batches


def checkpoints_enabled(cfg: TidalConfig) -> bool:
    return cfg.checkpoint.every > 0 or cfg.checkpoint.at_end


def check_run_dirs(cfg: TidalConfig, runtime: Runtime) -> None:
    """The run directory (and the checkpoint directory, when checkpoints are saved) is writable: fail at start."""
    ckpt.check_writable(Path(cfg.run.output_dir), rank=runtime.rank)
    if checkpoints_enabled(cfg):
        ckpt.check_writable(ckpt.checkpoint_root(cfg.run.output_dir), rank=runtime.rank)


def check_inputs(cfg: TidalConfig, paths: ResolvedPaths, algorithm: Algorithm) -> None:
    """Every local path the run reads exists, before anything is loaded (ConfigError naming the key)."""
    m = cfg.model
    folders = [("model.path", paths.model), ("model.tokenizer_path", m.tokenizer_path)]
    if algorithm.needs_critic:
        folders.append(("model.critic_path", m.critic_path))
    if algorithm.needs_reference:
        folders.append(("model.reference_path", m.reference_path))
    for key, path in folders:
        check(not path or os.path.isdir(path), key, f"{path!r} is not a local directory (Tidal never downloads; pass a local Hugging Face folder)")
    for key, sources in (("data.train", paths.train), ("data.eval", paths.eval)):
        for i, source in enumerate(sources):
            check(os.path.exists(source.path), f"{key}[{i}].path", f"{source.path!r} does not exist")


def build_trainer(cfg: TidalConfig) -> PPOTrainer:
    runtime = init_runtime(cfg.engine.tp_size, cfg.run.device, cfg.run.collective_timeout_s)
    cfg.check_world(runtime.world_size)
    check_run_dirs(cfg, runtime)
    start_step = _resume_step_hint(cfg, runtime)  # a bad checkpoint.resume fails here, before anything is loaded
    watchdog = Watchdog(rank=runtime.rank, world_size=runtime.world_size, run_dir=cfg.run.output_dir, timeout_s=cfg.run.collective_timeout_s)
    watchdog.start(runtime.cpu_group).mark("setup")
    seed_everything(cfg.run.seed)
    paths = resolve_paths(cfg, runtime)
    strategy = get_strategy(cfg.strategy, runtime)
    algorithm = Algorithm(cfg.algorithm, group=runtime.cpu_group)
    check_inputs(cfg, paths, algorithm)
    tokenizer = load_tokenizer(paths.tokenizer)
    require_chat_template(tokenizer, cfg.data)  # before any model is loaded

    actor_model = load_causal_lm(paths.model)
    if cfg.model.gradient_checkpointing:
        actor_model.gradient_checkpointing_enable()
    hf_config = actor_model.config
    actor_model = apply_lora(actor_model, cfg.model.lora, seed=cfg.run.seed)  # unchanged when model.lora.rank == 0
    actor = strategy.prepare_trainable(actor_model, cfg.optim, lr=cfg.optim.lr, total_steps=total_optimizer_steps(cfg))
    critic = None
    if algorithm.needs_critic:
        critic = strategy.prepare_trainable(load_critic(paths.critic), cfg.optim, lr=cfg.optim.critic_lr, total_steps=total_optimizer_steps(cfg))
    reference = None
    if algorithm.needs_reference and cfg.model.lora.enabled:
        reference = adapter_disabled_reference(actor.model)  # the base itself: no second copy
    elif algorithm.needs_reference:
        reference = strategy.prepare_frozen(load_causal_lm(paths.reference, what="model.reference_path"), offload=cfg.strategy.offload_reference)
    if cfg.strategy.offload_critic and critic is not None:
        strategy.offload_model(critic.model)
    if checkpoints_enabled(cfg):
        trained = [actor.model] + ([critic.model] if critic is not None else [])
        ckpt.check_free_space(ckpt.checkpoint_root(cfg.run.output_dir), ckpt.checkpoint_bytes(trained))

    engine = create_engine(hf_config, cfg.engine, device=runtime.device, tp_group=runtime.tp_group)
    dtype = engine_dtype(cfg.engine, runtime.device)
    strategy.update_engine_weights(actor.model, engine, dtype=dtype)
    strategy.sleep(engine, cfg.engine.sleep_level)

    reward_engine = RewardEngine(cfg.reward, device=runtime.device, placement=strategy)
    train_data = PromptDataset(paths.train, tokenizer, cfg.data, seed=cfg.run.seed)
    eval_items = []
    if paths.eval:
        eval_data = PromptDataset(paths.eval, tokenizer, cfg.data, seed=cfg.run.seed)
        n = len(eval_data) if cfg.eval.max_prompts == 0 else min(cfg.eval.max_prompts, len(eval_data))
        eval_items = [eval_data[i] for i in range(n)]
    sampler = StatefulDistributedSampler(
        len(train_data), rank=runtime.rank, world_size=runtime.world_size,
        batch_size_per_rank=cfg.rollout.prompts_per_step // runtime.world_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
    )
    logger = MetricsLogger(
        cfg.logging, Path(cfg.run.output_dir), is_main=runtime.is_main, total_steps=cfg.run.steps,
        start_step=start_step, hparams=cfg.to_dict(),
    )
    return PPOTrainer(
        cfg=cfg, strategy=strategy, tokenizer=tokenizer, actor=actor, critic=critic, reference=reference,
        engine=engine, engine_dtype=dtype, reward_engine=reward_engine, algorithm=algorithm, train_data=train_data,
        eval_items=eval_items, sampler=sampler, logger=logger, timer=StageTimer(watchdog), watchdog=watchdog,
    )


def _resume_step_hint(cfg: TidalConfig, runtime: Runtime) -> int:
    """The step a resume will continue from (for the logger), without loading anything. What an
    interrupted save left is settled first (rank 0; the others wait), as the resume itself will: a
    put-back ``step_N.old`` must be the step the logger keeps its records up to."""
    root = ckpt.checkpoint_root(cfg.run.output_dir)
    if runtime.is_main:
        ckpt.clean_partial(root)
    torch.distributed.barrier()
    path = ckpt.resolve_resume(cfg.checkpoint.resume, root)
    if path is None:
        return 0
    import json

    with open(path / ckpt.COMPLETE_MARKER) as f:
        return int(json.load(f)["step"])
