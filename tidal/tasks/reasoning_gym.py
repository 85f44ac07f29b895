"""reasoning-gym as a prompt source: its datasets generated once into the task store, checked first.

A data source with ``reasoning_gym`` (:class:`~tidal.data.config.ReasoningGymSource`) names
reasoning-gym datasets, their weights and settings, a size and a seed. :func:`check_sources` checks
them with the library before any model loads (the extra installed, every name a reasoning-gym
dataset, every setting accepted by that dataset's config class): one-line ConfigErrors naming the
key. :func:`resolve_sources` turns each such source into a JSONL file generated once under the
task store (``task.workdir/reasoning_gym-<hash of the settings, the data keys and the library
version>``, built atomically by :mod:`tidal.tasks.store`), so slow generators run once and every
later run (and every rank) reads the same rows.

A row: the question as ``data.prompt_key``, the answer as ``data.reference_key``, and the field
``reasoning_gym`` = ``{"dataset", "config", "entry"}``: the dataset's name and settings and the
library's entry (question, answer, metadata), which the reward rule ``reasoning_gym``
(:mod:`tidal.rewards.rules`) scores with that dataset's own ``score_answer``. The library is
imported only here and in that rule, and only when a config uses it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from tidal.config_base import ConfigError, to_dict
from tidal.data.config import DataConfig, DataSource, ReasoningGymSource
from tidal.optional_deps import require
from tidal.tasks.store import MARKER, asset_dir, ensure_built, write_jsonl

FIELD = "reasoning_gym"  # the row field holding the entry the reward rule scores
EXTRA = "reasoning-gym"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Generation:
    """What the generated rows depend on (its hash names the folder in the task store)."""

    source: dict
    keys: dict
    library_version: str
    name: str = "reasoning_gym"


def generated_sources(cfg: DataConfig) -> list[tuple[str, DataSource]]:
    """``(key, source)`` of every reasoning-gym source of ``data.train`` and ``data.eval``."""
    return [(f"data.{split}[{i}].reasoning_gym", s) for split in ("train", "eval")
            for i, s in enumerate(getattr(cfg, split)) if s.reasoning_gym is not None]


def check_sources(cfg: DataConfig) -> None:
    """ConfigError (one line, naming the key) when a reasoning-gym source cannot be generated: the
    extra is missing, a name is not a reasoning-gym dataset, or a dataset refuses its settings."""
    for key, source in generated_sources(cfg):
        require(EXTRA, key, "a reasoning-gym data source")
        _composite(source.reasoning_gym, key)


def _composite(spec: ReasoningGymSource, key: str):
    """The library's composite dataset of ``spec`` (ConfigError at ``key`` for a bad name or setting)."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec
    from reasoning_gym.factory import DATASETS

    for name, task in spec.datasets.items():
        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else f"e.g. {sorted(DATASETS)[:8]} "
            raise ConfigError(f"{key}.datasets.{name}", f"not a reasoning-gym dataset; {hint}"
                                                        f"({len(DATASETS)} in all: reasoning_gym.factory.DATASETS)")
        try:
            DATASETS[name][1](**task.config, size=1, seed=spec.seed).validate()
        except Exception as e:  # the config class's TypeError (unknown key) or the library's own assertion
            raise ConfigError(f"{key}.datasets.{name}.config", f"refused by reasoning-gym: {type(e).__name__}: {e}") from None
    specs = [DatasetSpec(name=name, weight=task.weight, config=dict(task.config)) for name, task in spec.datasets.items()]
    return CompositeDataset(CompositeConfig(size=spec.size, seed=spec.seed, datasets=specs))


def rows(spec: ReasoningGymSource, cfg: DataConfig, key: str = "reasoning_gym") -> list[dict[str, Any]]:
    """The ``spec.size`` prompt rows of ``spec`` (see the module docstring), JSON round-tripped as
    they are stored (the reward scores the stored entry)."""
    dataset = _composite(spec, key)
    out = []
    for i in range(spec.size):
        entry = dataset[i]
        name = entry["metadata"]["source_dataset"]
        record = {"dataset": name, "config": dict(spec.datasets[name].config), "entry": entry}
        row = {cfg.prompt_key: entry["question"], cfg.reference_key: str(entry["answer"]), FIELD: record}
        out.append(json.loads(json.dumps(row, default=_jsonable)))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"reasoning-gym metadata holds a {type(value).__name__}, which JSON cannot store")


def resolve_sources(cfg: DataConfig, sources: list[DataSource], workdir: str) -> list[DataSource]:
    """``sources`` with each reasoning-gym source replaced by its generated JSONL file (same weight),
    generating it first unless the task store holds it. Call on one rank and barrier first."""
    out = []
    for i, source in enumerate(sources):
        spec = source.reasoning_gym
        if spec is None:
            out.append(source)
            continue
        version = require(EXTRA, "data.reasoning_gym", "a reasoning-gym data source")
        keys = {"prompt_key": cfg.prompt_key, "reference_key": cfg.reference_key}
        gen = _Generation(source=to_dict(spec), keys=keys, library_version=version)
        root = ensure_built(gen, asset_dir(gen, workdir), lambda g, tmp: _build(spec, cfg, tmp), key="task.workdir")
        out.append(DataSource(path=str(root / "rows.jsonl"), weight=source.weight))
    return out


def _build(spec: ReasoningGymSource, cfg: DataConfig, out: Path) -> None:
    from tidal.logging.progress import stage

    with stage(f"generating {spec.size} reasoning-gym rows ({', '.join(spec.datasets)})"):
        write_jsonl(out / "rows.jsonl", rows(spec, cfg))
    (out / MARKER).write_text(json.dumps({"settings": to_dict(spec)}, indent=2))
