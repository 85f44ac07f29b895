"""Wiring a reward-model run from its config: runtime, strategy, tokenizer, data, model, logging.

Each function builds one thing; :func:`build_reward_model_trainer` calls them in order. Paths and
data are checked before the model loads, so bad input fails in seconds.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import numpy as np
import torch

from tidal.config_base import ConfigError, check
from tidal.data import DataSource, StatefulDistributedSampler
from tidal.data.loaders import check_source
from tidal.data.prompts import require_chat_template
from tidal.data.vision import VisionProcessor
from tidal.distributed import Runtime, init_runtime
from tidal.distributed.runtime import set_cpu_threads
from tidal.logging import MetricsLogger
from tidal.models import load_tokenizer
from tidal.optional_deps import check_dependencies
from tidal.rm.dataset import PreferenceDataset
from tidal.rm.model import load_trainable_reward_model
from tidal.rm.trainer import RM_STATE_KEYS, RewardModelTrainer
from tidal.strategy import get_strategy
from tidal.run import checkpoint as ckpt
from tidal.memory.plan import settings_without_plan
from tidal.run.resume import check_world_change, compare_config, resolve_resume_point
from tidal.run.run_dir import announce_run_dir, claim_run_dir
from tidal.run.watchdog import StageTimer, Watchdog


@dataclasses.dataclass(kw_only=True)
class RMPaths:
    """Where the model, tokenizer and pairs come from: the config's paths or the built-in task's."""

    model: str
    tokenizer: str
    train: list[DataSource]
    eval: list[DataSource]


def resolve_paths(cfg, runtime: Runtime) -> RMPaths:
    """The config's paths, or the task's assets (built on rank 0 while the others wait)."""
    task = cfg.reward_model.task
    if not task.name:
        m = cfg.model
        return RMPaths(model=m.path, tokenizer=m.tokenizer_path or m.path, train=list(cfg.data.train), eval=list(cfg.data.eval))
    from tidal.rm.task import prepare

    if runtime.is_main:
        prepare(task)
    runtime.barrier()
    assets = prepare(task)  # idempotent: the paths of what rank 0 built
    return RMPaths(model=assets.model_path, tokenizer=assets.model_path,
                   train=[DataSource(path=assets.train_path)], eval=[DataSource(path=assets.eval_path)])


def check_inputs(paths: RMPaths) -> None:
    """Every local path the run reads exists (a data file as a regular file) (ConfigError naming the key), before anything loads."""
    for key, path in (("model.path", paths.model), ("model.tokenizer_path", paths.tokenizer)):
        check(os.path.isdir(path), key, f"{path!r} is not a local directory (Tidal never downloads; pass a local Hugging Face folder)")
    check(os.path.isfile(os.path.join(paths.model, "config.json")), "model.path", f"{paths.model!r} has no config.json; is it a Hugging Face model folder?")
    for key, sources in (("data.train", paths.train), ("data.eval", paths.eval)):
        for i, source in enumerate(sources):
            check_source(source, f"{key}[{i}].path")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def load_data(cfg, paths: RMPaths, tokenizer, runtime: Runtime) -> tuple[PreferenceDataset, list]:
    """The training pairs and the first ``eval.max_prompts`` eval pairs (all when 0)."""
    train = PreferenceDataset(paths.train, tokenizer, cfg.data, cfg.reward_model, seed=cfg.run.seed)
    eval_pairs = []
    if paths.eval:
        held_out = PreferenceDataset(paths.eval, tokenizer, cfg.data, cfg.reward_model, seed=cfg.run.seed)
        n = len(held_out) if cfg.eval.max_prompts == 0 else min(cfg.eval.max_prompts, len(held_out))
        eval_pairs = [held_out[i] for i in range(n)]
    if runtime.is_main:
        print(f"[tidal] preference pairs: train {train.summary()}; eval {len(eval_pairs)} pairs", flush=True)
    return train, eval_pairs


def build_reward_model_trainer(cfg, *, read_only: bool = False) -> RewardModelTrainer:
    """Everything a ``job: reward_model`` run needs, from its config (the root ``TidalConfig``).
    ``read_only`` (``tidal eval``/``export`` of ``checkpoint.resume``): nothing is written into the
    run directory -- no lock, no settling of partial saves, no heartbeat, metrics or config file."""
    check_dependencies(cfg)  # optional packages (deepspeed, logging backends) before anything starts
    runtime = init_runtime(1, cfg.run.device, cfg.run.collective_timeout_s)
    set_cpu_threads(cfg.run.cpu_threads, runtime.device)
    cfg.check_world(runtime.world_size)
    saves = (cfg.checkpoint.every > 0 or cfg.checkpoint.at_end) and not read_only
    if read_only:
        resume = resolve_resume_point(cfg.checkpoint, cfg.run.output_dir, runtime, required_keys=RM_STATE_KEYS)
    else:
        run_dir = claim_run_dir(cfg.run.output_dir, cfg.checkpoint, runtime, required_keys=RM_STATE_KEYS)
        compare_config(run_dir, cfg.to_dict(), is_main=runtime.is_main)  # what a resume may not change: a ConfigError, before anything loads
        resume = run_dir.resume
    watchdog = Watchdog(rank=runtime.rank, world_size=runtime.world_size, run_dir=cfg.run.output_dir, timeout_s=cfg.run.collective_timeout_s,
                        topology=runtime.topology)
    if not read_only:  # a watchdog never started writes no heartbeat
        watchdog.start(runtime).mark("setup")
    seed_everything(cfg.run.seed)
    paths = resolve_paths(cfg, runtime)
    check_inputs(paths)
    # `auto` settings (micro-batch budgets, gradient checkpointing, optimizer offload) as a run
    # without a memory plan takes them; every component below reads this resolved config
    run_cfg = settings_without_plan(cfg).run_config(cfg, engine=False)
    strategy = get_strategy(run_cfg.strategy, runtime)
    check_world_change(resume, runtime, reshards=strategy.reshards_checkpoints)
    tokenizer = load_tokenizer(paths.tokenizer)
    if isinstance(tokenizer, VisionProcessor):
        raise ConfigError("model.tokenizer_path", "has an image processor; reward-model training supports text models only")
    require_chat_template(tokenizer, cfg.data)
    train_data, eval_pairs = load_data(cfg, paths, tokenizer, runtime)
    model = load_trainable_reward_model(paths.model, tokenizer_pad_id=tokenizer.pad_token_id, seed=cfg.run.seed)
    if run_cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    pad_id = model.config.pad_token_id
    state = strategy.prepare_trainable(model, cfg.optim, lr=cfg.optim.lr, total_steps=cfg.run.steps)
    if saves:
        ckpt.check_free_space(ckpt.checkpoint_root(cfg.run.output_dir), ckpt.checkpoint_bytes([state.model]), keep=cfg.checkpoint.keep)
    sampler = StatefulDistributedSampler(
        len(train_data), rank=runtime.rank, world_size=runtime.world_size,
        batch_size_per_rank=cfg.reward_model.batch_pairs // runtime.world_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
        data_hash=train_data.content_hash,
    )
    # read-only: a logger that writes nothing (as on ranks other than the main one)
    logger = MetricsLogger(cfg.logging, Path(cfg.run.output_dir), is_main=runtime.is_main and not read_only, total_steps=cfg.run.steps,
                           start_step=resume.step if resume is not None else 0, hparams=run_cfg.to_dict())
    if runtime.is_main and not read_only:
        announce_run_dir(cfg)  # the config as written
    return RewardModelTrainer(
        cfg=run_cfg, strategy=strategy, tokenizer=tokenizer, state=state, pad_id=pad_id, train_data=train_data,
        eval_pairs=eval_pairs, sampler=sampler, logger=logger, timer=StageTimer(watchdog), watchdog=watchdog, resume=resume,
    )
