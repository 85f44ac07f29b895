"""Wiring a run from its config: runtime, strategy, models, engine, rewards, data, logging.

Each function builds one thing; :func:`build_trainer` only calls them in order (spec §7
"initialise": ranks and process groups, wrapped models, engine, first weight sync, engine to sleep).
This module sits above the components it wires (it reads the root config and hands each
component its own sections); nothing below imports it.

Derived values are computed once, here: the engine's dtype (:func:`tidal.dtypes.resolve_dtype`;
the strategy resolves its own compute dtype once when built), the rollout TP groups (from
``engine.tp_size``, checked against the world in :func:`tidal.distributed.runtime.rollout_group_ranks`),
the resume point (:func:`tidal.run.resume.resolve_resume_point`) and the memory plan's
settings (:func:`tidal.memory.probe.plan_run`, before any model loads): every component
built after it is handed the config with its ``auto`` settings resolved
(:meth:`~tidal.memory.plan.MemorySettings.run_config`).
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from tidal.algorithms import Algorithm
from tidal.config import TidalConfig
from tidal.config_base import ConfigError
from tidal.data import DataSource, PromptDataset, PromptItem, StatefulDistributedSampler
from tidal.envs import make_env_factory
from tidal.envs.base import env_class
from tidal.data.prompts import require_chat_template
from tidal.distributed import Runtime, init_runtime
from tidal.distributed.runtime import set_cpu_threads
from tidal.distributed.topology import describe_sharding
from tidal.dtypes import resolve_dtype
from tidal.engine.factory import create_engine
from tidal.inputs import ResolvedPaths, check_data, check_inputs, choose_engine
from tidal.logging import MetricsLogger
from tidal.logging.progress import stage
from tidal.distill.remote import RemoteTeacher
from tidal.models import load_causal_lm, load_critic, load_tokenizer
from tidal.models.loading import check_context_fits, check_same_tokenizer, check_tokenizer_fits, model_positions, tokenizer_fingerprint
from tidal.models.logprobs import set_exact
from tidal.models.lora import adapter_disabled_reference, apply_lora
from tidal.models.moe import moe_training
from tidal.families import find_family, text_config
from tidal.models.varlen import enable_packed_attention
from tidal.numerics import check_exact_model
from tidal.optional_deps import check_dependencies
from tidal.rewards import RewardEngine
from tidal.strategy import Strategy, get_strategy
from tidal.tasks.reasoning_gym import generated_sources, resolve_sources
from tidal.run import checkpoint as ckpt
from tidal.trainer.colocation import Colocation, Models
from tidal.trainer.config import require_resolved
from tidal.memory.probe import plan_run
from tidal.trainer.ppo_trainer import EVAL_SEED_SALT, PPOTrainer, RunData, step_seed
from tidal.trainer.experience_maker import ExperienceMaker
from tidal.trainer.evaluate import CheckpointPolicy
from tidal.memory.plan import settings_without_plan
from tidal.run.resume import check_world_change, compare_config, resolve_resume_point
from tidal.run.run_dir import announce_run_dir, claim_run_dir
from tidal.run.watchdog import StageTimer, Watchdog



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_paths(cfg: TidalConfig, runtime: Runtime) -> ResolvedPaths:
    """Build the task's assets and generate the reasoning-gym rows on rank 0 (others wait)."""
    m = cfg.model
    if generated_sources(cfg.data):  # reasoning-gym rows: generated once into the task store, then read
        if runtime.is_main:
            resolve_sources(cfg.data, cfg.data.train + cfg.data.eval, cfg.task.workdir)
        runtime.barrier()
    train, eval_ = (resolve_sources(cfg.data, s, cfg.task.workdir) for s in (cfg.data.train, cfg.data.eval))
    if not cfg.task.name:
        return ResolvedPaths(
            model=m.path, tokenizer=m.tokenizer_path or m.path, critic=m.critic_path or m.path,
            reference=m.reference_path or m.path, train=train, eval=eval_,
        )
    from tidal.tasks import prepare

    if runtime.is_main:
        prepare(cfg.task, run_threads=cfg.run.cpu_threads)
    runtime.barrier()
    assets = prepare(cfg.task)  # idempotent: returns the paths of what rank 0 built
    if not cfg.data.train:  # the task's prompts (with reasoning-gym sources the task gives the model only)
        train, eval_ = [DataSource(path=assets.train_path)], [DataSource(path=assets.eval_path)]
    return ResolvedPaths(model=assets.model_path, tokenizer=assets.model_path, critic=assets.model_path,
                         reference=assets.model_path, train=train, eval=eval_)


def total_optimizer_steps(cfg: TidalConfig) -> int:
    return cfg.run.steps * cfg.train.epochs * cfg.train.mini_batches


def checkpoints_enabled(cfg: TidalConfig) -> bool:
    return cfg.checkpoint.every > 0 or cfg.checkpoint.at_end




def check_context_budget(cfg: TidalConfig, hf_config) -> None:
    """The longest sequence fits the model's positions, then the training micro-batches, in that
    order (a context beyond the model is the problem to name, not the micro-batch that cannot hold
    it). ``hf_config`` None (a built-in task not built yet): the micro-batches only. A multi-turn
    run's ``env.max_total_tokens`` (tokens after the prompt) must fit the positions too."""
    d, r, e = cfg.data, cfg.rollout, cfg.env
    positions = model_positions(hf_config) if hf_config is not None else None
    if hf_config is not None:
        check_context_fits(hf_config, max_prompt_len=d.max_prompt_len, max_new_tokens=r.max_new_tokens)
    if positions is not None and e.max_total_tokens and d.max_prompt_len + e.max_total_tokens > positions:
        raise ConfigError("env.max_total_tokens", f"data.max_prompt_len ({d.max_prompt_len}) + env.max_total_tokens "
                          f"({e.max_total_tokens}) = {d.max_prompt_len + e.max_total_tokens} exceeds the model's {positions} "
                          f"positions (max_position_embeddings); set env.max_total_tokens <= {positions - d.max_prompt_len} "
                          "(or 0: the model's context)")
    cfg.check_micro_batches()



def check_model_and_data(cfg: TidalConfig, paths: ResolvedPaths, hf_config) -> tuple[object, list[str]]:
    """(the tokenizer, what was checked of the data): everything a run checks of the model's config,
    its tokenizer and the data before any model loads, in order -- the context budget, the tokenizer
    against the model, the chat template, then every source's sampled rows. ``tidal check`` and
    ``tidal train`` both call it."""
    check_context_budget(cfg, hf_config)
    family = find_family(hf_config)  # an unknown family runs on engine.backend: hf, as a dense model
    cfg.moe.check_model(family is not None and family.moe(text_config(hf_config)) is not None, hf_config.model_type)
    check_exact_model(cfg, hf_config)
    tokenizer = load_tokenizer(paths.tokenizer)
    if paths.tokenizer != paths.model:  # load_tokenizer checks against its own folder's model config
        check_tokenizer_fits(tokenizer, hf_config)
    require_chat_template(tokenizer, cfg.data)
    return tokenizer, check_data(cfg, paths, tokenizer, model_positions(hf_config))


def build_actor(cfg: TidalConfig, paths: ResolvedPaths, strategy: Strategy):
    """(the actor sharded for training, its HF config); ``cfg`` as resolved by the memory plan."""
    require_resolved(cfg.model, "model", "gradient_checkpointing")
    actor_model = enable_packed_attention(load_causal_lm(paths.model))
    set_exact(actor_model, cfg.numerics.exact)  # the old logprobs and the update's forward (docs/exact.md)
    hf_config = actor_model.config  # read before wrapping: a DeepSpeed engine's .config is its own
    if cfg.model.gradient_checkpointing:
        actor_model.gradient_checkpointing_enable()
    actor_model = apply_lora(actor_model, cfg.model.lora, seed=cfg.run.seed)  # unchanged when model.lora.rank == 0
    actor = strategy.prepare_trainable(actor_model, cfg.optim, lr=cfg.optim.lr, total_steps=total_optimizer_steps(cfg))
    return actor, hf_config


def build_models(cfg: TidalConfig, paths: ResolvedPaths, strategy: Strategy, algorithm: Algorithm, tokenizer):
    """(models, the actor's HF config): the actor (and critic) sharded for training, the reference
    sharded for inference; where each waits between phases is the phase owner's decision, not made
    here. ``cfg``: the run's config as resolved by the memory plan (``model.gradient_checkpointing``
    a bool, for the actor and the critic alike)."""
    actor, hf_config = build_actor(cfg, paths, strategy)
    steps = total_optimizer_steps(cfg)
    critic = None
    if algorithm.needs_critic:
        critic_model = enable_packed_attention(load_critic(paths.critic))
        if cfg.model.gradient_checkpointing:
            critic_model.gradient_checkpointing_enable()
        critic = strategy.prepare_trainable(critic_model, cfg.optim, lr=cfg.optim.critic_lr, total_steps=steps)
    reference = None
    if algorithm.needs_reference and cfg.model.lora.enabled:
        reference = adapter_disabled_reference(actor.model)  # the base itself: no second copy
    elif algorithm.needs_reference:
        reference = strategy.prepare_frozen(enable_packed_attention(load_causal_lm(paths.reference, what="model.reference_path")), offload=False)
    teacher = remote_teacher = None
    t = cfg.model.teacher
    if t.path:
        teacher_tok = load_tokenizer(t.path)
        check_same_tokenizer(tokenizer, tokenizer_fingerprint(teacher_tok), key="model.teacher.path",
                             teacher_vocab=len(getattr(teacher_tok, "tokenizer", teacher_tok).get_vocab()))
        teacher = strategy.prepare_frozen(enable_packed_attention(load_causal_lm(t.path, what="model.teacher.path")), offload=False)
    elif t.url:
        remote_teacher = RemoteTeacher(t)
        check_same_tokenizer(tokenizer, remote_teacher.info()["tokenizer_sha256"], key="model.teacher.url")
    models = Models(tokenizer=tokenizer, actor=actor, critic=critic, reference=reference, teacher=teacher,
                    remote_teacher=remote_teacher, positions=model_positions(hf_config),
                    moe=moe_training(actor.model, cfg.moe, hf_config))
    return models, hf_config


def build_eval_items(cfg: TidalConfig, paths: ResolvedPaths, tokenizer) -> list[PromptItem]:
    """The first ``eval.max_prompts`` eval prompts (all when 0; none without ``data.eval``)."""
    if not paths.eval:
        return []
    eval_data = PromptDataset(paths.eval, tokenizer, cfg.data, seed=cfg.run.seed)
    n = len(eval_data) if cfg.eval.max_prompts == 0 else min(cfg.eval.max_prompts, len(eval_data))
    return [eval_data[i] for i in range(n)]


def build_data(cfg: TidalConfig, paths: ResolvedPaths, tokenizer, runtime: Runtime) -> RunData:
    train = PromptDataset(paths.train, tokenizer, cfg.data, seed=cfg.run.seed)
    eval_items = build_eval_items(cfg, paths, tokenizer)
    sampler = StatefulDistributedSampler(
        len(train), rank=runtime.rank, world_size=runtime.world_size,
        batch_size_per_rank=cfg.rollout.prompts_per_step // runtime.world_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
        data_hash=train.content_hash,
    )
    return RunData(train=train, sampler=sampler, eval_items=eval_items)


def with_absolute_output_dir(cfg: TidalConfig) -> TidalConfig:
    """``cfg`` with ``run.output_dir`` made absolute against the current directory, once, at start:
    a reward function that calls ``os.chdir`` cannot send checkpoints and metrics elsewhere
    (``cfg`` itself when it is absolute already)."""
    if os.path.isabs(cfg.run.output_dir):
        return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=os.path.abspath(cfg.run.output_dir)))


def build_trainer(cfg: TidalConfig) -> PPOTrainer:
    written, cfg = cfg, with_absolute_output_dir(cfg)  # config.yaml records the config as written
    check_dependencies(cfg)  # optional packages (logging backends, deepspeed, peft, vllm) before anything starts
    runtime = init_runtime(cfg.engine.tp_size, cfg.run.device, cfg.run.collective_timeout_s)
    set_cpu_threads(cfg.run.cpu_threads, runtime.device)
    cfg.check_world(runtime.world_size)
    if runtime.is_main:
        for warning in cfg.learning_warnings():
            print(f"[tidal] warning: {warning}", file=sys.stderr, flush=True)
    # the directory's lock, partial saves settled, writability, the resume point: before anything loads
    run_dir = claim_run_dir(cfg.run.output_dir, cfg.checkpoint, runtime)
    compare_config(run_dir, cfg.to_dict(), is_main=runtime.is_main)  # what a resume may not change: a ConfigError, before anything loads
    shard = runtime.topology.shard_size(cfg.strategy.shard_setting())  # strategy.shard checked against the nodes
    if runtime.is_main and runtime.world_size > 1:
        print(f"[tidal] ranks: {runtime.topology.describe()}; {describe_sharding(shard, runtime.world_size)}", flush=True)
    watchdog = Watchdog(rank=runtime.rank, world_size=runtime.world_size, run_dir=cfg.run.output_dir, timeout_s=cfg.run.collective_timeout_s,
                        topology=runtime.topology)
    watchdog.start(runtime).mark("setup")
    seed_everything(cfg.run.seed)
    paths = resolve_paths(cfg, runtime)
    algorithm = Algorithm(cfg.algorithm, group=runtime.cpu_group)
    check_inputs(cfg, paths, algorithm)
    engine_line = choose_engine(cfg, paths.model)
    if runtime.is_main:
        print(f"[tidal] {engine_line}", flush=True)
    hf_config = AutoConfig.from_pretrained(paths.model)
    tokenizer, _ = check_model_and_data(cfg, paths, hf_config)
    env_class(cfg.env).log_to(os.path.join(cfg.run.output_dir, "env_logs", f"rank{runtime.rank}"))
    make_env_factory(cfg.env)  # the environment's own settings (env.kwargs), by building one, as `tidal check` does
    # the memory plan (CUDA, or memory.device_memory_gib): printed, `auto` settings chosen; a run
    # that cannot fit stops here, before any model loads
    teacher_path = cfg.model.teacher.path if algorithm.needs_teacher else ""
    memory = plan_run(
        cfg, hf_config, device=runtime.device, world_size=runtime.world_size, num_nodes=runtime.topology.num_nodes,
        is_main=runtime.is_main,
        needs_reference=algorithm.needs_reference, needs_critic=algorithm.needs_critic,
        teacher_hf_config=AutoConfig.from_pretrained(teacher_path) if teacher_path else None,
        all_reduce_max=runtime.all_reduce_max,
    )
    run_cfg = memory.run_config(cfg)  # what every component below reads: no `auto` left for the plan's settings

    strategy = get_strategy(run_cfg.strategy, runtime)
    check_world_change(run_dir.resume, runtime, reshards=strategy.reshards_checkpoints)
    with stage(f"loading and sharding the models ({paths.model})", enabled=runtime.is_main):
        models, hf_config = build_models(run_cfg, paths, strategy, algorithm, tokenizer)
    if checkpoints_enabled(cfg):
        trained = [models.actor.model] + ([models.critic.model] if models.critic is not None else [])
        ckpt.check_free_space(ckpt.checkpoint_root(cfg.run.output_dir), ckpt.checkpoint_bytes(trained), keep=cfg.checkpoint.keep)
    colocation = Colocation(strategy=strategy, models=models, timer=StageTimer(watchdog))
    engine_dtype = resolve_dtype(run_cfg.engine.dtype, runtime.device)
    with stage(f"starting the {run_cfg.engine.backend} rollout engine and syncing its weights", enabled=runtime.is_main):
        engine = create_engine(hf_config, run_cfg.engine, device=runtime.device, dtype=engine_dtype,
                               tp_group=runtime.tp_group, seq_len=run_cfg.data.max_prompt_len + run_cfg.rollout.max_new_tokens,
                               exact=run_cfg.numerics.exact)
        colocation.attach_engine(engine, dtype=engine_dtype, sleep_level=run_cfg.engine.sleep_level, verify=run_cfg.sync.verify)

    rewards = RewardEngine(run_cfg.reward, device=runtime.device, placement=colocation)
    with stage("loading the prompts", enabled=runtime.is_main) as shown:
        data = build_data(run_cfg, paths, tokenizer, runtime)
        shown.done(f"{len(data.train)} training prompts from {data.train.num_rows} rows ({data.train.num_dropped} dropped as "
                   f"overlong, {data.train.num_truncated} left-truncated); {len(data.eval_items)} eval prompts")
    logger = MetricsLogger(
        run_cfg.logging, Path(cfg.run.output_dir), is_main=runtime.is_main, total_steps=cfg.run.steps,
        start_step=run_dir.resume.step if run_dir.resume is not None else 0, hparams=run_cfg.to_dict(),
    )
    for observer in logger.observers():  # the console's step bar shows the phase a step is in
        colocation.timer.add_observer(observer)
    if runtime.is_main:
        announce_run_dir(written)  # the config as written (`auto` kept: a rerun plans again)
    trainer = PPOTrainer(cfg=run_cfg, colocation=colocation, models=models, rewards=rewards, algorithm=algorithm, data=data,
                         logger=logger, run_dir=run_dir)
    trainer.memory = memory  # the settings the run was built with, and the plan behind them (None without one)
    return trainer


def build_checkpoint_policy(cfg: TidalConfig, *, evaluate: bool) -> CheckpointPolicy:
    """``tidal eval`` / ``tidal export``: the actor of the checkpoint ``checkpoint.resume`` (a path),
    loaded read-only. Nothing is written into the run directory (no lock, no settling of partial
    saves, no metrics, config or heartbeat files), and only what the command uses is loaded: the
    actor's weights (not the sampler or trainer state, so the training overrides need not be
    repeated), and with ``evaluate`` the rollout engine, the rewards and the eval prompts; no
    critic, reference, teacher or training prompts. No memory plan is made (nothing trains)."""
    check_dependencies(cfg)
    runtime = init_runtime(cfg.engine.tp_size, cfg.run.device, cfg.run.collective_timeout_s)
    cfg.check_world(runtime.world_size)
    point = resolve_resume_point(cfg.checkpoint, cfg.run.output_dir, runtime)  # read-only checks of the path
    seed_everything(cfg.run.seed)
    paths = resolve_paths(cfg, runtime)
    algorithm = Algorithm(cfg.algorithm, group=runtime.cpu_group)
    check_inputs(cfg, dataclasses.replace(paths, train=[]), algorithm)  # the training prompts are not read
    tokenizer = load_tokenizer(paths.tokenizer)
    run_cfg = settings_without_plan(cfg, longest=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens).run_config(cfg)
    strategy = get_strategy(run_cfg.strategy, runtime)
    check_world_change(point, runtime, reshards=strategy.reshards_checkpoints)
    actor, hf_config = build_actor(run_cfg, paths, strategy)
    models = Models(tokenizer=tokenizer, actor=actor, positions=model_positions(hf_config))
    # a watchdog never started: it writes no heartbeat into the run directory
    timer = StageTimer(Watchdog(rank=runtime.rank, world_size=runtime.world_size, run_dir=cfg.run.output_dir,
                                timeout_s=cfg.run.collective_timeout_s))
    colocation = Colocation(strategy=strategy, models=models, timer=timer)
    loaded = ckpt.load_resume(str(point.path), ckpt.checkpoint_root(cfg.run.output_dir), rank=runtime.rank,
                              model_states=lambda: {"actor": strategy.state_dict(actor)}, runtime=runtime,
                              required_keys=ckpt.TRAINER_STATE_KEYS)
    strategy.load_state_dict(actor, loaded[1]["actor"])
    policy = CheckpointPolicy(cfg=run_cfg, rt=runtime, colocation=colocation, models=models, path=point.path, step=point.step,
                              eval_seed=step_seed(cfg.run.seed, point.step, runtime.rank, salt=EVAL_SEED_SALT))
    if evaluate:
        engine_dtype = resolve_dtype(run_cfg.engine.dtype, runtime.device)
        engine = create_engine(hf_config, run_cfg.engine, device=runtime.device, dtype=engine_dtype, tp_group=runtime.tp_group,
                               seq_len=run_cfg.data.max_prompt_len + run_cfg.rollout.max_new_tokens, exact=run_cfg.numerics.exact)
        colocation.attach_engine(engine, dtype=engine_dtype, sleep_level=run_cfg.engine.sleep_level, verify=run_cfg.sync.verify)
        rewards = RewardEngine(run_cfg.reward, device=runtime.device, placement=colocation)
        policy.maker = ExperienceMaker(colocation=colocation, rewards=rewards, algorithm=algorithm, rollout=run_cfg.rollout,
                                       train=run_cfg.train, model=run_cfg.model, env=run_cfg.env, reward=run_cfg.reward)
        policy.eval_items = build_eval_items(run_cfg, paths, tokenizer)
    return policy
