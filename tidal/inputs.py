"""What a run checks of its inputs before anything loads, torch-free: the paths it reads, the engine
its model's ``config.json`` gets, and a sample of every data source's rows against the config.

``tidal train`` (:mod:`tidal.build`) and ``tidal check`` (:mod:`tidal.check`) call the same
functions. Nothing here imports torch or transformers: ``tidal check`` runs the data check with the
folder's tokenizer read by ``tokenizers`` alone (:mod:`tidal.data.tokenizer_file`) before it imports
the model stack, so a bad row is named in about a second.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tidal.algorithms import Algorithm
from tidal.config import TidalConfig
from tidal.config_base import check
from tidal.data.check import sample_rows
from tidal.data.config import DataSource
from tidal.data.loaders import check_source
from tidal.engine.backends import engine_choice


@dataclasses.dataclass(kw_only=True)
class ResolvedPaths:
    """Where the model and data come from: the config's paths, or a built-in task's assets."""

    model: str
    tokenizer: str
    critic: str
    reference: str
    train: list[DataSource]
    eval: list[DataSource]


def check_inputs(cfg: TidalConfig, paths: ResolvedPaths, algorithm: Algorithm) -> None:
    """Every local path the run reads exists (a data file as a regular file), before anything is loaded (ConfigError naming the key)."""
    m = cfg.model
    folders = [("model.path", paths.model), ("model.tokenizer_path", m.tokenizer_path)]
    if algorithm.needs_critic:
        folders.append(("model.critic_path", m.critic_path))
    if algorithm.needs_reference:
        folders.append(("model.reference_path", m.reference_path))
    if m.teacher.path:
        folders.append(("model.teacher.path", m.teacher.path))
    for key, path in folders:
        check(not path or os.path.isdir(path), key, f"{path!r} is not a local directory (Tidal never downloads; pass a local Hugging Face folder)")
    for key, sources in (("data.train", paths.train), ("data.eval", paths.eval)):
        for i, source in enumerate(sources):
            check_source(source, f"{key}[{i}].path")


def choose_engine(cfg: TidalConfig, model_path: str) -> str:
    """The line saying which rollout engine runs the model and why (:func:`tidal.engine.backends.engine_choice`),
    from ``model_path``'s ``config.json`` read as a dict (before transformers parses it: a model type
    it does not know is named here too); ConfigError at ``engine.backend`` when ``native`` cannot run it."""
    path = os.path.join(model_path, "config.json")
    check(os.path.isfile(path), "model.path", f"{model_path!r} has no config.json (a Hugging Face model folder has one)")
    with open(path) as f:
        raw = json.load(f)
    return engine_choice(raw, cfg.engine.backend)


def check_data(cfg: TidalConfig, paths: ResolvedPaths, tokenizer, positions: int | None = None) -> list[str]:
    """Every data source's sampled rows (:func:`tidal.data.check.sample_rows`; every row of a
    reasoning-gym source, generated and cheap to read) against the config: fields, prompt lengths
    (with advice that fits the model's ``positions``), the label's recipe and what its rule
    components can read of the reference (:meth:`~tidal.rewards.config.RewardConfig.check_row`).
    ConfigError on the first failure; returns one line per source saying what was checked."""
    lines = []
    room = positions - cfg.rollout.max_new_tokens if positions is not None else None
    for name, sources in (("data.train", paths.train), ("data.eval", paths.eval)):
        configured = getattr(cfg.data, name.removeprefix("data."))
        for i, source in enumerate(sources):
            generated = i < len(configured) and configured[i].reasoning_gym is not None  # paths.* keep the config's order
            sampled = sample_rows(source, cfg.data, tokenizer, key=f"{name}[{i}]", room=room, every_row=generated)
            for row in sampled:
                cfg.reward.check_row(row.where, row.parsed.label, row.parsed.reference)
            longest = max((r.prompt_tokens for r in sampled if r.prompt_tokens is not None), default=0)
            labels = sorted({r.parsed.label or "(none)" for r in sampled})
            lines.append(f"data: {source.path}: {len(sampled)} rows checked (fields, labels {', '.join(labels)}, "
                         f"references); longest prompt {longest} tokens of data.max_prompt_len {cfg.data.max_prompt_len}")
    return lines
