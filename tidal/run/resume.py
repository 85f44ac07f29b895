"""Where a run resumes from: resolved once, at setup, before anything is loaded.

``checkpoint.resume`` (``auto``, ``never`` or a path) is turned into a :class:`ResumePoint` (the
checkpoint directory and its step) or None for a fresh run. What an interrupted save left is settled
first (rank 0; the others wait), so a put-back ``step_N.old`` is the step that the logger keeps its
records up to and the one the trainer loads. The config of the run is then compared with the one the
checkpoint was trained with (:func:`check_config_change`), and its number of ranks with this run's
(:func:`check_world_change`: a checkpoint outlives the topology where the backend reshards it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tidal.config_base import ConfigError, load_yaml
from tidal.distributed.runtime import Runtime
from tidal.run import checkpoint as ckpt
from tidal.run.config import CheckpointConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumePoint:
    path: Path
    step: int


def resolve_resume_point(cfg: CheckpointConfig, output_dir: str, runtime: Runtime, *,
                         required_keys: tuple[str, ...] = ckpt.TRAINER_STATE_KEYS) -> ResumePoint | None:
    """The checkpoint to resume from (a collective; partial saves are settled before, by
    :func:`tidal.run.run_dir.open_run_dir`). Under ``auto`` the newest checkpoint that passes the
    cheap checks (:func:`tidal.run.checkpoint.checkpoint_problems`) is taken, every rank agreeing;
    a bad explicit ``checkpoint.resume`` is a ConfigError naming what is wrong."""
    root = ckpt.checkpoint_root(output_dir)
    if cfg.resume == "never":
        earlier = runtime.broadcast_object(earlier_run(output_dir) if runtime.is_main else None)
        if earlier is not None:
            raise ConfigError("checkpoint.resume", f"is 'never' but {output_dir} holds an earlier run ({earlier}); a fresh "
                              "run there would delete its metrics and its checkpoints would be rotated away by the older, "
                              "higher steps. Choose: checkpoint.resume=auto to continue it, checkpoint.resume=<one of its "
                              "checkpoints> to start from that one, or another run.output_dir (or remove the directory) "
                              "for a fresh run")
        return None
    path = ckpt.resolve_resume(cfg.resume, root, runtime=runtime, required_keys=required_keys)
    if path is None:
        return None
    with open(path / ckpt.COMPLETE_MARKER) as f:
        return ResumePoint(path=path, step=int(json.load(f)["step"]))


def earlier_run(output_dir: str) -> str | None:
    """What an earlier run left in ``output_dir`` (its complete checkpoints, its metrics), or None."""
    found = []
    saved = ckpt.complete_checkpoints(ckpt.checkpoint_root(output_dir))
    if saved:
        found.append(f"{len(saved)} checkpoint(s) up to {saved[-1].name}")
    metrics = Path(output_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(f"{metrics.name}")
    return ", ".join(found) or None


# ---- another number of ranks on resume ----------------------------------------------------------------


def world_record(runtime: Runtime) -> dict[str, int]:
    """The topology a checkpoint was saved on (``world`` in its trainer.json)."""
    t = runtime.topology
    return {"world_size": t.world_size, "num_nodes": t.num_nodes, "ranks_per_node": t.ranks_per_node}


def check_world_change(point: ResumePoint | None, runtime: Runtime, *, reshards: bool) -> None:
    """A resume on another number of ranks than the checkpoint was saved on. Where the backend's
    checkpoints reshard (``reshards``: FSDP2's DCP state, any layout into any other) the main rank
    says what changes: DCP reshards model and optimizer state, the sampler's position (stored in
    global items, the global batch ``rollout.prompts_per_step`` unchanged) is re-split over the new
    ranks, each rank present in both restores its RNG state and a new rank keeps its seeded one. Else
    (DeepSpeed: each rank's ZeRO partition is its own) a ConfigError at ``checkpoint.resume``. A
    checkpoint that recorded no topology (saved before it was recorded) is not checked."""
    if point is None:
        return
    with open(point.path / ckpt.COMPLETE_MARKER) as f:
        saved = json.load(f).get("world")
    if not isinstance(saved, dict) or saved.get("world_size") == runtime.world_size:
        return
    was = (f"{saved['world_size']} ranks ({saved.get('num_nodes', 1)} node(s) x {saved.get('ranks_per_node', saved['world_size'])})")
    now = f"{runtime.world_size} ranks ({runtime.topology.num_nodes} node(s) x {runtime.topology.ranks_per_node})"
    if not reshards:
        raise ConfigError("checkpoint.resume", f"{point.path} was saved on {was} and this run has {now}: a "
                          "strategy.backend=deepspeed checkpoint loads only on the number of ranks it was saved on (each "
                          f"rank's ZeRO partition is its own); resume on {saved['world_size']} ranks, or train with "
                          "strategy.backend=fsdp2, whose checkpoints reshard")
    if runtime.is_main:
        print(f"[tidal] resuming {point.path.name}, saved on {was}, on {now}: model and optimizer state resharded, the "
              "sampler's position re-split over the ranks (same global batch)", flush=True)


# ---- a changed config on resume ----------------------------------------------------------------------

# What a resume may not change: the keys that decide the training data, its order and the batch shape
# (the sampler's position and the RNG states would mean something else), and the shape of the saved
# state. A key ending in "." stands for its section; NOT_FIXED are exceptions inside such a section.
FIXED = (
    "job", "run.seed", "data.", "task.", "rollout.prompts_per_step", "rollout.n_samples", "reward_model.batch_pairs",
    "reward_model.task.", "reward_model.chosen_key", "reward_model.rejected_key", "reward_model.separator",
    "reward_model.max_length", "reward_model.overlong", "reward_model.bad_pairs", "algorithm.advantage",
    "optim.weight_decay", "model.path", "model.critic_path", "model.lora.",
)
NOT_FIXED = ("data.eval", "task.workdir", "task.sft_threads", "reward_model.task.workdir")
NOT_COMPARED = ("checkpoint.resume",)  # how this run finds its checkpoint, not how it trains


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _is_fixed(key: str) -> bool:
    def hits(names: tuple[str, ...]) -> bool:
        return any(key == n or (n.endswith(".") and key.startswith(n)) or key.startswith(n + ".") for n in names)

    return hits(FIXED) and not hits(NOT_FIXED)


# Keys that name a file or folder: compared as the paths they resolve to (from the working directory),
# so `runs/x` and `/home/me/runs/x` (or `~/x` and `/home/me/x`) naming one folder are no change.
PATH_KEYS = ("run.output_dir", "model.path", "model.tokenizer_path", "model.critic_path", "model.reference_path",
             "task.workdir", "reward_model.task.workdir")
PATH_LIST_KEYS = ("data.train", "data.eval")  # lists of sources, each with a `path`


def _resolved(path: Any) -> Any:
    return str(Path(path).expanduser().resolve()) if isinstance(path, str) and path else path


def _same(key: str, old: Any, new: Any) -> bool:
    """Whether ``old`` and ``new`` of ``key`` are one setting (paths: one file or folder)."""
    if old == new:
        return True
    if key in PATH_KEYS:
        return _resolved(old) == _resolved(new)
    if key in PATH_LIST_KEYS and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        def norm(source):
            return {**source, "path": _resolved(source.get("path"))} if isinstance(source, dict) else _resolved(source)

        return [norm(s) for s in old] == [norm(s) for s in new]
    return False


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, value now)}`` for every key whose value differs (a key only on
    one side has ``None`` on the other; paths differ when they resolve to different places),
    ``checkpoint.resume`` aside."""
    a, b = _flat(saved), _flat(now)
    keys = sorted(set(a) | set(b))
    return {k: (a.get(k), b.get(k)) for k in keys
            if not _same(k, a.get(k), b.get(k)) and not any(k.startswith(n) for n in NOT_COMPARED)}


def check_config_change(point: ResumePoint | None, config: dict[str, Any], *, is_main: bool) -> dict[str, tuple[Any, Any]]:
    """Compare this run's config as written (``config``, the root config's ``to_dict()``) with the
    one the checkpoint of ``point`` was trained with (its ``config.yaml``; a checkpoint without one
    has nothing to compare). A key that may not change (:data:`FIXED`: seed, data, batch shape,
    the saved state's shape) is a ConfigError naming it; every other change applies from the next
    step and is said in one line (main rank). Returns the changes."""
    if point is None or not (point.path / ckpt.CONFIG_RECORD).is_file():
        return {}
    record = point.path / ckpt.CONFIG_RECORD
    saved = load_yaml(record.read_text(encoding="utf-8"), str(record)) or {}
    changes = config_changes(saved, config)
    for key, (old, new) in changes.items():
        if _is_fixed(key):
            raise ConfigError(key, f"is {new!r} but the checkpoint {point.path} was trained with {old!r}; it cannot change "
                                   f"on resume (it decides the data, its order or the batch shape): set it back to {old!r}, "
                                   "or start a new run in another run.output_dir")
    if changes and is_main:
        shown = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
        print(f"[tidal] resume: changed since the checkpoint of step {point.step}, applied from step {point.step + 1}: {shown}", flush=True)
    return changes


def compare_config(run_dir, config: dict[str, Any], *, is_main: bool) -> dict[str, tuple[Any, Any]]:
    """:func:`check_config_change` for a claimed run directory (a :class:`tidal.run.run_dir.RunDir`:
    its resume point and lock); a ConfigError releases the lock. Every job's builder calls it right
    after claiming the directory, before anything loads."""
    try:
        return check_config_change(run_dir.resume, config, is_main=is_main)
    except ConfigError:
        run_dir.lock.release()
        raise
