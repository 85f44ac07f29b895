"""``tidal check CONFIG [overrides]``: everything a run checks before it loads a model, without
training, then what the run will do.

Checked in this order (each failure is the run's own ConfigError, exit 2): the config and its
overrides, the optional packages it needs (:mod:`tidal.optional_deps`); torch-free
(:func:`check_data_first`, about a second): every local path the run reads (model folders, data
files) and a sample of the rows of every data source with the model folder's tokenizer read by
``tokenizers`` alone -- fields, prompt lengths, labels against ``reward.recipes``, and whether each
rule component can read the references (:mod:`tidal.data.check`); then, with torch: the device this
process would get (``run.device``, ranks per node against GPUs, under torchrun too) and the world
against ``engine.tp_size`` and the batch sizes, then what :func:`tidal.build.check_model_and_data`
checks for ``tidal train`` too: the model's context against ``data.max_prompt_len +
rollout.max_new_tokens`` (and ``env.max_total_tokens``) before the micro-batches, the tokenizer the
run loads, and the data's sample again with it. With a model folder at hand it prints the memory
plan that exists before anything loads: the engine's weights per rank, KV-cache bytes per token
and, on CUDA, the KV budget and the tokens it holds. A built-in task (``task.name``) builds its
assets at the first run, so its model and data are not read here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tidal import families
from tidal.config import TidalConfig

if TYPE_CHECKING:
    import torch


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_lines(cfg: TidalConfig, world_size: int, device: torch.device) -> list[str]:
    """What the run will do, one fact a line."""
    r, e = cfg.rollout, cfg.engine
    lines = [
        f"job: {cfg.job}; {cfg.run.steps} steps into {cfg.run.output_dir} (metrics.jsonl, checkpoints/ every "
        f"{cfg.checkpoint.every or 'never'}; logging: {', '.join(cfg.logging.backends)})",
        f"ranks: {world_size} on {device}; strategy {cfg.strategy.backend}" + _threads_text(cfg, device),
    ]
    if cfg.job == "rl":
        model = f"task {cfg.task.name!r} (built in {cfg.task.workdir} at the first run)" if cfg.task.name else cfg.model.path
        lines += [
            f"model: {model}; rollout engine {e.backend} with tp_size {e.tp_size}",
            f"each step: {r.prompts_per_step} prompts x {r.n_samples} samples, up to {r.max_new_tokens} new tokens; "
            f"algorithm {cfg.algorithm.advantage} / {cfg.algorithm.policy_loss}, kl_coef {cfg.algorithm.kl_coef}",
            f"eval: every {cfg.eval.every or 'never'} steps" + (", and at the start" if cfg.eval.at_start else ""),
        ]
    return lines


def _threads_text(cfg: TidalConfig, device: torch.device) -> str:
    """``; 1 CPU thread per rank (...)`` on CPU (:func:`tidal.distributed.runtime.cpu_threads`)."""
    if device.type != "cpu":
        return ""
    from tidal.distributed.runtime import cpu_threads

    n = cpu_threads(cfg.run.cpu_threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    why = "run.cpu_threads" if cfg.run.cpu_threads else "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "half the cores"
    return f"; {n} CPU thread{'s' if n != 1 else ''} per rank ({why})"


def memory_lines(cfg: TidalConfig, device: torch.device) -> list[str]:
    """The memory plan known before loading (engine weights, KV bytes per token, the CUDA KV budget);
    empty when no model folder is at hand (a built-in task, or a job without an engine)."""
    if cfg.job != "rl" or cfg.task.name or not cfg.model.path:
        return []
    from transformers import AutoConfig

    from tidal.dtypes import resolve_dtype
    from tidal.engine import sizing

    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    dtype = resolve_dtype(cfg.engine.dtype, device)
    lines = [f"memory: engine weights {_gib(sizing.weight_bytes_per_rank(hf_config, dtype, cfg.engine.tp_size))} per rank ({dtype})"]
    if families.find_family(hf_config) is None:  # engine.backend: hf (native refused it earlier)
        return lines + [f"memory: KV cache: {hf_config.model_type!r} has no family in tidal/families; not counted"]
    per_token = sizing.kv_bytes_per_token(hf_config, dtype, cfg.engine.tp_size)
    lines.append(f"memory: KV cache {per_token / 1024:.1f} KiB per token ({cache_summary(families.layer_caches(hf_config))})")
    if sizing.sized_by_memory(device) and per_token:
        budget = sizing.kv_budget_bytes(cfg.engine, sizing.available_device_bytes(device))
        lines.append(f"memory: KV budget {_gib(budget)} now free x engine.kv_cache_memory_fraction = "
                     f"{_kv_budget_tokens(cfg, families.layer_caches(hf_config), dtype, budget)}")
    return lines


def _kv_budget_tokens(cfg: TidalConfig, caches: list[families.LayerCache], dtype: torch.dtype, budget: int) -> str:
    """The tokens a KV budget holds in the native engine's pools (full layers; window layers')."""
    import torch

    from tidal.engine import sizing

    eng, bs = cfg.engine, cfg.engine.block_size
    nbytes = torch.empty(0, dtype=dtype).element_size()
    window = families.pool_window(caches)
    full_b = bs * families.kv_bytes_per_token([c for c in caches if window is None or c.kind == "full_kv"], nbytes, eng.tp_size)
    window_b = 0 if window is None else bs * families.kv_bytes_per_token([c for c in caches if c.kind == "window_kv"], nbytes, eng.tp_size)
    full, win = sizing.split_kv_pools(lambda n, w: n * full_b + w * window_b, budget, block_size=bs, window=window,
                                      seq_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
                                      max_num_batched_tokens=eng.max_num_batched_tokens)
    if window is None:
        return f"{full * bs:,} tokens"
    return f"{full * bs:,} tokens ({win * bs:,} in the sliding-window layers' pool)"


def memory_plan_lines(cfg: TidalConfig, hf_config, algorithm, *, device: torch.device, world_size: int) -> list[str]:
    """The memory plan the run would make (:func:`tidal.memory.probe.make_plan`), its table with the
    settings it chooses for ``auto`` (marked so); a ConfigError, as the run would stop, when nothing
    fits. On a CPU without ``memory.device_memory_gib`` one line saying that none is made."""
    from tidal.memory.plan import apply_plan
    from tidal.memory.probe import make_plan, plans_on

    if not plans_on(device, cfg.memory):
        return [f"memory plan: none on {device.type} (the auto settings take their fixed values; set "
                "memory.device_memory_gib to see the plan for a GPU of that size)"]
    from transformers import AutoConfig

    teacher = cfg.model.teacher.path if algorithm.needs_teacher else ""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    plan = make_plan(cfg, hf_config, device=device, world_size=world_size, num_nodes=max(1, world_size // local),
                     needs_reference=algorithm.needs_reference, needs_critic=algorithm.needs_critic,
                     teacher_hf_config=AutoConfig.from_pretrained(teacher) if teacher else None)
    apply_plan(plan)
    return plan.table().splitlines()


def cache_summary(caches: list[families.LayerCache]) -> str:
    """What the layers keep, e.g. ``4 full-attention layers; 12 sliding-window layers (1024 tokens),
    full KV kept by the native engine``."""
    kinds = [c.kind for c in caches]
    parts = []
    if kinds.count("full_kv"):
        parts.append(f"{kinds.count('full_kv')} full-attention layers")
    windows = sorted({c.window for c in caches if c.kind == "window_kv"})
    if windows:
        kept = ("the native engine keeps at most a window of KV per sequence in their own block pool"
                if families.has_window_pool(caches) else "the native engine keeps their full KV and applies the window")
        parts.append(f"{kinds.count('window_kv')} sliding-window layers ({', '.join(map(str, windows))} tokens; {kept})")
    if kinds.count("recurrent"):
        per_seq = families.state_bytes_per_sequence(caches, 1)
        parts.append(f"{kinds.count('recurrent')} recurrent layers (no KV; {per_seq / 1024:.1f} KiB of state per sequence)")
    return "; ".join(parts)


def _check_task(cfg: TidalConfig) -> list[str]:
    """A built-in task's run: the context budget against its model's positions and, when
    ``data.train`` gives the prompts (reasoning-gym rows, files), every check of those rows with its
    tokenizer, as ``tidal train`` makes them once the task is built (the task's own rows are built
    with it)."""
    from tidal.build import check_context_budget
    from tidal.inputs import ResolvedPaths, check_data
    from tidal.models.loading import model_positions
    from tidal.tasks.assets import model_config_and_tokenizer
    from tidal.tasks.reasoning_gym import resolve_sources

    hf_config, tokenizer = model_config_and_tokenizer(cfg.task)
    check_context_budget(cfg, hf_config)
    if not cfg.data.train:
        return []
    train, eval_ = (resolve_sources(cfg.data, sources, cfg.task.workdir) for sources in (cfg.data.train, cfg.data.eval))
    paths = ResolvedPaths(model="", tokenizer="", critic="", reference="", train=train, eval=eval_)
    return check_data(cfg, paths, tokenizer, model_positions(hf_config))


def check(cfg: TidalConfig) -> list[str]:
    """Run the checks (ConfigError on the first failure) and return the lines to print."""
    from tidal.optional_deps import check_dependencies

    check_dependencies(cfg)
    paths = _config_paths(cfg)
    if paths is not None:
        check_data_first(cfg, paths)  # torch-free: a bad path or row is named before the model stack is imported
    from tidal.run.run_dir import check_output_dir  # (imports torch)

    check_output_dir(cfg.run.output_dir)
    if cfg.job == "rl":  # the environment's own settings (env.kwargs: an MCP tool, an OpenEnv class), by building one
        from tidal.envs import make_env_factory

        make_env_factory(cfg.env)
    from tidal.distributed.runtime import resolve_device, rollout_group_ranks

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.run.device, int(os.environ.get("LOCAL_RANK", "0")),
                            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), tp_size=cfg.engine.tp_size)
    cfg.check_world(world)
    data_lines: list[str] = []
    if cfg.job == "rl":
        from transformers import AutoConfig

        from tidal.build import check_model_and_data
        from tidal.inputs import choose_engine

        rollout_group_ranks(world, cfg.engine.tp_size)
        if cfg.task.name:  # the task's model is built at the first run: its config and tokenizer are made without it
            data_lines = _check_task(cfg)
        else:
            from tidal.algorithms import Algorithm

            engine_line = choose_engine(cfg, paths.model)
            hf_config = AutoConfig.from_pretrained(paths.model)
            _, data_lines = check_model_and_data(cfg, paths, hf_config)
            data_lines = [engine_line] + data_lines + memory_plan_lines(cfg, hf_config, Algorithm(cfg.algorithm), device=device,
                                                                        world_size=world)
    return (plan_lines(cfg, world, device) + data_lines + memory_lines(cfg, device)
            + [f"warning: {w}" for w in cfg.learning_warnings()])


def _config_paths(cfg: TidalConfig):
    """The :class:`tidal.inputs.ResolvedPaths` of an RL job from a model folder (reasoning-gym rows
    generated once, then read), None for other jobs and built-in tasks."""
    if cfg.job != "rl" or cfg.task.name:
        return None
    from tidal.inputs import ResolvedPaths
    from tidal.tasks.reasoning_gym import resolve_sources

    m = cfg.model
    train, eval_ = (resolve_sources(cfg.data, sources, cfg.task.workdir) for sources in (cfg.data.train, cfg.data.eval))
    return ResolvedPaths(model=m.path, tokenizer=m.tokenizer_path or m.path, critic=m.critic_path or m.path,
                         reference=m.reference_path or m.path, train=train, eval=eval_)


def check_data_first(cfg: TidalConfig, paths) -> list[str] | None:
    """The paths and the data check (:func:`tidal.inputs.check_data`) with the model folder's
    tokenizer read by ``tokenizers`` alone (:func:`tidal.data.tokenizer_file.load_tokenizer_file`),
    before torch and transformers are imported: its lines, or None where the tokenizer is one only
    transformers loads. ``paths``: :func:`_config_paths`. ConfigError on the first bad path or row.
    The run's own check (:func:`tidal.build.check_model_and_data`, with the tokenizer the run loads)
    follows it either way."""
    from tidal.algorithms import Algorithm
    from tidal.data.prompts import require_chat_template
    from tidal.data.tokenizer_file import load_tokenizer_file
    from tidal.inputs import check_data, check_inputs

    check_inputs(cfg, paths, Algorithm(cfg.algorithm))
    tokenizer = load_tokenizer_file(paths.tokenizer)
    if tokenizer is None:
        return None
    require_chat_template(tokenizer, cfg.data)
    return check_data(cfg, paths, tokenizer)
