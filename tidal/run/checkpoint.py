"""Atomic, rotated, sharded checkpoints (torch.distributed.checkpoint) and exact resume.

Layout: ``<output_dir>/checkpoints/step_000010/`` holding the DCP shards of every trained model and
its optimizer + scheduler, ``trainer.json`` (step, sampler and algorithm state) and ``rng_rank<R>.pt``
(every RNG of each rank). A checkpoint is written into ``step_000010.tmp`` and renamed only when
every rank has finished: a crash mid-save leaves the previous checkpoint as the newest complete
one, and the partial ``.tmp`` directory is removed at the next save or resume. With several nodes
``output_dir`` must be on a filesystem every node sees.

Reading a checkpoint never runs code from it: DCP's ``.metadata`` pickle is read with an allow-list
of the classes DCP writes, its non-tensor items and the RNG files with ``torch.load(weights_only=True)``
(:class:`SafeFileSystemReader`, :class:`SafeLoadPlanner`, :func:`load_rng_file`).

Each checkpoint holds a copy of the run's ``config.yaml`` (:data:`CONFIG_RECORD`): a resume compares
its own config with it (:func:`tidal.run.resume.check_config_change`).

Resume (``checkpoint.resume``): :func:`resolve_resume` picks the checkpoint without loading tensors,
after checking that it looks loadable (:func:`checkpoint_problems`: trainer.json, DCP metadata, every
shard file present and long enough, RNG files). ``auto`` skips (with a warning) complete checkpoints
that do not, newest first; an explicit path that does not is a ConfigError at ``checkpoint.resume``
naming the problem. :func:`load_resume` also falls back to the next older one when loading itself
fails under ``auto``, when a file fails its checksum (``checksums.json``: the crc32 of every shard and
RNG file, written by :func:`save_checkpoint` before the marker; flipped bytes; a checkpoint whose
``trainer.json`` says this version wrote it but that lacks ``checksums.json`` is incomplete, found
by the cheap checks) or when the loaded
weights hold NaN/Inf (:func:`nonfinite_names`). With a ``runtime`` (its host collectives, over gloo)
rank 0 decides and the ranks agree on the outcome of each load attempt; without one this process
decides alone.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tidal.config_base import ConfigError
from tidal.distributed.runtime import Runtime
from tidal.run import faults

COMPLETE_MARKER = "trainer.json"
CHECKSUMS = "checksums.json"  # {file relative to the checkpoint: crc32}, of every file but the marker
# trainer.json's record of the checkpoint layout: 2 (this version) writes CHECKSUMS before the marker, so
# a checkpoint of format 2 without it is incomplete; checkpoints without the key predate checksums
FORMAT_KEY, FORMAT = "checkpoint_format", 2
CONFIG_RECORD = "config.yaml"  # the run's config as written (in its run directory), copied into each checkpoint
REQUIRED_KEYS = ("step",)  # what every job's trainer.json holds; a job passes the keys it reads
TRAINER_STATE_KEYS = ("step", "sampler", "algorithm", "trainer")  # what the RL trainer reads
_STEP_RE = re.compile(r"^step_(\d+)$")
_RNG_RE = re.compile(r"^rng_rank(\d+)\.pt$")
_FULL_DISK_BYTES = 64 * 2**20  # less free than this after a failed write: say the disk is full


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed; the message names the step, each failing rank's error and the
    free space left (a full disk often shows only as a torch zip-writer error)."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded; the message names it and each failing rank's error."""


class NonFiniteWeightsError(RuntimeError):
    """The trained weights (or their optimizer state) hold NaN/Inf: no checkpoint is written of them."""


def error_summary(exc: BaseException) -> str:
    """One line per failing rank of a DCP CheckpointException (its str() holds whole tracebacks)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        text = str(exc).strip()
        line = text.splitlines()[0] if text else ""
        return f"{type(exc).__name__}: {line if len(line) <= 160 else line[:157] + '...'}"
    parts = []
    for r, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        parts.append(f"rank {r}: {error_summary(inner)}")
    return "; ".join(parts)


def checkpoint_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and (p / COMPLETE_MARKER).is_file()]
    return [p for _, p in sorted(found)]


def enclosing_checkpoint(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint (a ``step_N`` directory holding ``trainer.json``) that ``path`` is or
    lies inside, symlinks resolved; None when there is none."""
    target = Path(path).expanduser().resolve()
    for p in (target, *target.parents):
        if _STEP_RE.match(p.name) and (p / COMPLETE_MARKER).is_file():
            return p
    return None


def check_outside_checkpoints(path: str | os.PathLike, *, key: str) -> None:
    """ConfigError at ``key`` when ``path`` is, or lies inside, a checkpoint (:func:`enclosing_checkpoint`):
    whatever is written there (a run's ``config.yaml``, an export) changes the checkpoint, which then
    fails its checksums. ``run.output_dir`` and ``tidal export --out`` are both checked here."""
    found = enclosing_checkpoint(path)
    if found is not None:
        raise ConfigError(key, f"{path} is inside the checkpoint {found} (a run's checkpoint must stay as it was saved): "
                               "choose a folder outside it")


def clean_partial(root: Path) -> list[str]:
    """Settle what an interrupted save left (rank 0 only): remove ``*.tmp`` directories; a
    ``step_N.old`` (an interrupted re-save of step N) is put back when ``step_N`` is missing,
    else removed. Returns the names removed or put back.

    Call it before anything writes to the run directory (:func:`settle_and_probe`): a save that
    failed with ENOSPC leaves a partial ``step_N.tmp`` holding the space every later write needs."""
    removed = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.endswith(".tmp") and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
            elif p.name.endswith(".old") and p.is_dir():
                final = p.with_name(p.name[: -len(".old")])
                if final.exists():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.rename(final)
                removed.append(p.name)
    return removed


def check_writable(directory: Path, *, rank: int, key: str = "run.output_dir") -> None:
    """Create ``directory`` and write, fsync and remove a probe file in it, so that an unwritable
    run or checkpoint directory fails at start (ConfigError at ``key`` naming it), not at the first
    save hours later. Every rank probes (each writes its own shards)."""
    probe = directory / f".write_probe_rank{rank}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"tidal")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        try:  # a probe cut short by a full disk must not stay behind
            probe.unlink(missing_ok=True)
        except OSError:
            pass
        raise ConfigError(key, f"cannot write to {directory}: {type(e).__name__}: {e.strerror or e}") from None


def settle_and_probe(output_dir: str, *, rank: int, checkpoints: bool, barrier: Callable[[], None]) -> list[str]:
    """The start-of-run order for the run directory (collective through ``barrier``):

    1. rank 0 settles what an interrupted save left (:func:`clean_partial`), the others wait: a
       partial ``step_N.tmp`` of a save that hit ENOSPC is removed *before* anything else is
       written, so its space is free again for the probes and the next save;
    2. every rank probes ``output_dir`` (and the checkpoint directory when ``checkpoints`` and it
       exists already, e.g. as a read-only folder or a file) with :func:`check_writable`. A
       checkpoint directory not there yet is made by the first save: a run stopped before it (a
       data error) leaves no empty ``checkpoints/``.

    Returns what rank 0 removed or put back (empty on the other ranks)."""
    root = checkpoint_root(output_dir)
    settled = clean_partial(root) if rank == 0 else []
    barrier()
    check_writable(Path(output_dir), rank=rank)
    if checkpoints and (root.exists() or root.is_symlink()):
        check_writable(root, rank=rank)
    return settled


def checkpoint_bytes(models: list[torch.nn.Module]) -> int:
    """About what one checkpoint takes: fp32 trainable weights plus AdamW's two fp32 moments."""
    return sum(12 * p.numel() for m in models for p in m.parameters() if p.requires_grad)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_free_space(directory: Path, need_bytes: int, *, keep: int = 1, key: str = "run.output_dir") -> None:
    """ConfigError at ``key`` when ``directory``'s filesystem cannot hold what the run's saves will
    put there at their peak: a save writes the new checkpoint while the older complete ones still
    exist, and rotates them down to ``keep`` only after it, so the peak is ``max(n, keep) + 1``
    checkpoints, ``n`` of them (the complete ones already there) already taking their space.

    One checkpoint is taken as ``need_bytes`` (:func:`checkpoint_bytes`), or as the size of the
    newest existing one when that is larger. Settle partial saves first (:func:`clean_partial`):
    their space is free once they are removed."""
    existing = complete_checkpoints(directory)
    per_checkpoint = max(need_bytes, _tree_bytes(existing[-1])) if existing else need_bytes
    new_ones = max(keep - len(existing), 0) + 1
    need = new_ones * per_checkpoint
    free = shutil.disk_usage(directory if directory.exists() else directory.parent).free  # made by the first save
    if free < need:
        have = f" beside the {len(existing)} already there" if existing else ""
        raise ConfigError(
            key, f"{directory} has {free / 2**30:.2f} GiB free but the checkpoints of this run need about "
            f"{need / 2**30:.2f} GiB ({new_ones} x {per_checkpoint / 2**30:.2f} GiB{have}: a save writes the new one "
            f"before rotating down to checkpoint.keep={keep}); free disk space, lower checkpoint.keep, point "
            "run.output_dir elsewhere or disable checkpoints (checkpoint.every=0, checkpoint.at_end=false)",
        )


# ---- safe reading -----------------------------------------------------------------------------------


def _metadata_allowed(module: str, name: str) -> bool:
    """The globals a DCP ``.metadata`` pickle may name: DCP's own metadata classes, the storage info
    of the filesystem writer, torch sizes, dtypes, layouts and memory formats, and paths."""
    if module == "torch.distributed.checkpoint.metadata":
        import torch.distributed.checkpoint.metadata as md

        return isinstance(getattr(md, name, None), type)
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    }


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _metadata_allowed(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"'{module}.{name}' is not allowed in checkpoint metadata (a crafted file?)")


def read_dcp_metadata(models_dir: Path) -> Metadata:
    """DCP's ``.metadata`` of ``models_dir`` unpickled under the allow-list (no code runs)."""
    with open(models_dir / ".metadata", "rb") as f:
        md = _MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's filesystem reader whose metadata is read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def _state_globals() -> list[Any]:
    """The classes, beyond tensors and containers, that Tidal's own state dicts hold: DeepSpeed's
    ZeRO optimizer state (its loss scaler, ZeRO stage enum and parameter fragment addresses) when
    DeepSpeed is in use. Plain data holders: unpickling one sets its fields and runs no code."""
    if "deepspeed" not in sys.modules:
        return []
    found = []
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return found


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but the non-tensor items of a state dict (optimizer
    hyper-parameters, scheduler state, DeepSpeed's optimizer settings) are read with
    ``torch.load(weights_only=True)`` and the allow-list of :func:`_state_globals`."""

    def load_bytes(self, read_item, value) -> None:
        with torch.serialization.safe_globals(_state_globals()):
            obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---- RNG states ----------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every RNG of this process in a form ``torch.load(weights_only=True)`` reads: tensors, tuples,
    ints, floats, strings (numpy's key array as an int64 tensor)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    kind, keys, *rest = st["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What a pickled numpy array needs (RNG files of checkpoints written before the RNG state was
    stored as tensors): torch's documented allow-list for numpy arrays, no code."""
    multiarray = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rng_file(path: Path) -> dict[str, Any]:
    """An ``rng_rank<R>.pt`` read with ``weights_only=True`` (numpy arrays allowed, nothing that runs code)."""
    with torch.serialization.safe_globals(_numpy_array_globals()):
        st = torch.load(path, weights_only=True)
    if not isinstance(st, dict) or not {"python", "numpy", "torch"} <= set(st):
        raise ValueError(f"{path.name} is not a Tidal RNG state (keys python, numpy, torch)")
    return st


# ---- validation and resume ----------------------------------------------------------------------------


def _trainer_state_problem(path: Path, required_keys: tuple[str, ...]) -> str | None:
    marker = path / COMPLETE_MARKER
    try:
        with open(marker, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return f"no {COMPLETE_MARKER}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{COMPLETE_MARKER} is not valid JSON ({type(e).__name__}: {e})"
    if not isinstance(state, dict):
        return f"{COMPLETE_MARKER} holds a {type(state).__name__}, not an object"
    missing = [k for k in required_keys if k not in state]
    if missing:
        return f"{COMPLETE_MARKER} lacks {missing}"
    if not isinstance(state["step"], int) or isinstance(state["step"], bool) or state["step"] < 0:
        return f"{COMPLETE_MARKER} has step={state['step']!r}, not a step number"
    if state.get(FORMAT_KEY, 1) >= FORMAT and not (path / CHECKSUMS).is_file():
        return f"no {CHECKSUMS} (the save that wrote {COMPLETE_MARKER} writes it first: the checkpoint is incomplete or was altered)"
    return None


def _shard_problems(models: Path) -> list[str]:
    if not (models / ".metadata").is_file():
        return [f"no {models.name}/.metadata"]
    try:
        md = read_dcp_metadata(models)
    except Exception as e:  # noqa: BLE001 -- any failure to read it is the finding
        return [f"{models.name}/.metadata cannot be read ({type(e).__name__}: {e})"]
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in Path(rel).parts:
            return [f"{models.name}/.metadata names a shard outside the checkpoint: {rel!r}"]
        needed[rel] = max(needed.get(rel, 0), end)
    problems = []
    for rel, end in sorted(needed.items()):
        f = models / rel
        if not f.is_file():
            problems.append(f"missing shard {models.name}/{rel}")
        elif f.stat().st_size < end:
            problems.append(f"truncated shard {models.name}/{rel} ({f.stat().st_size} bytes, its data ends at byte {end})")
    return problems


def _rng_problems(path: Path) -> list[str]:
    problems = []
    for f in sorted(path.iterdir()):
        if _RNG_RE.match(f.name):
            try:
                load_rng_file(f)
            except Exception as e:  # noqa: BLE001 -- any failure to read it is the finding
                problems.append(f"{f.name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return problems


def checkpoint_problems(path: Path, *, required_keys: tuple[str, ...] = REQUIRED_KEYS) -> list[str]:
    """What would keep ``path`` from loading, found without loading a tensor (empty: it looks
    loadable): ``trainer.json`` is a JSON object with ``required_keys`` and, when this version wrote
    it (``checkpoint_format`` 2), ``checksums.json`` is there (``step`` by default; the RL
    trainer's are ``TRAINER_STATE_KEYS``); ``models/.metadata``
    unpickles under the allow-list; every shard file it references exists and is at least as long
    as the byte ranges it holds there; every ``rng_rank<R>.pt`` loads with ``weights_only=True``."""
    if not path.is_dir():
        return ["not a directory"]
    problem = _trainer_state_problem(path, required_keys)
    if problem is not None:
        return [problem]
    return _shard_problems(path / "models") + _rng_problems(path)


# ---- checksums and non-finite values -----------------------------------------------------------------


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_checksums(directory: Path) -> None:
    """Write ``CHECKSUMS`` into ``directory`` (a checkpoint being saved, every rank's files written):
    the crc32 of each file under it, the marker aside (rank 0; one read of the checkpoint)."""
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f.name not in (COMPLETE_MARKER, CHECKSUMS))
    sums = {str(f.relative_to(directory)): file_crc32(f) for f in files}
    with open(directory / CHECKSUMS, "w", encoding="utf-8") as f:
        json.dump(sums, f)
        f.flush()
        os.fsync(f.fileno())


def checksum_problems(path: Path) -> list[str]:
    """The files of checkpoint ``path`` whose bytes differ from what was saved (``CHECKSUMS``; a
    checkpoint saved before checksums were written has nothing to compare: []; one saved since
    without them is found incomplete earlier, by :func:`checkpoint_problems`)."""
    try:
        with open(path / CHECKSUMS, encoding="utf-8") as f:
            sums = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{CHECKSUMS} is not valid JSON ({type(e).__name__})"]
    problems = []
    for rel, crc in sorted(sums.items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"missing {rel}")
        elif file_crc32(f) != crc:
            problems.append(f"{rel} fails its checksum (its bytes changed since the save)")
    return problems


def _float_tensors(states: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, local tensor)`` of every non-empty floating-point tensor of the nested ``states``
    (a DTensor's local shard)."""
    items = states.items() if isinstance(states, dict) else enumerate(states) if isinstance(states, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.is_floating_point() and local.numel():
                yield name, local
        else:
            yield from _float_tensors(value, name)


@torch.no_grad()
def nonfinite_names(states: Any, limit: int = 3) -> list[str]:
    """The names (``a.b.c``) of up to ``limit`` floating-point tensors of the nested ``states`` that
    hold NaN or Inf, this rank's local shards only (a DTensor's local tensor). One host sync per
    device when every tensor is finite (the common case: it runs after every update)."""
    named = list(_float_tensors(states))
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in named:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return []
    return [name for name, t in named if not bool(torch.isfinite(t).all())][:limit]


def _warn(message: str, runtime: Runtime | None = None) -> None:
    if runtime is None or runtime.is_main:
        print(f"[tidal] warning: {message}", file=sys.stderr, flush=True)


def _from_rank0(compute: Callable[[], Any], runtime: Runtime | None) -> Any:
    """``compute()`` on rank 0, broadcast to every rank; without a runtime this process computes it."""
    if runtime is None:
        return compute()
    return runtime.broadcast_object(compute() if runtime.is_main else None)


def resume_candidates(
    resume: str, root: Path, *, runtime: Runtime | None = None, required_keys: tuple[str, ...] = REQUIRED_KEYS,
    warn: bool = True,
) -> list[Path]:
    """The checkpoints a resume may load, in the order to try them (every rank gets the same list):
    ``never`` -> []; ``auto`` -> the complete checkpoints under ``root`` that look loadable
    (:func:`checkpoint_problems`), newest first, each skipped one named in a warning (unless not
    ``warn``: said already); a path -> [it], or a ConfigError at ``checkpoint.resume`` naming what
    is wrong with it."""
    if resume == "never":
        return []
    if resume == "auto":

        def scan() -> tuple[list[str], list[str]]:
            good, skipped = [], []
            for path in reversed(complete_checkpoints(root)):
                problems = checkpoint_problems(path, required_keys=required_keys)
                (skipped.append(f"{path}: {'; '.join(problems)}") if problems else good.append(str(path)))
            return good, skipped

        good, skipped = _from_rank0(scan, runtime)
        for s in skipped if warn else ():
            _warn(f"checkpoint.resume=auto skips {s}", runtime)
        return [Path(p) for p in good]
    path = Path(resume)
    problems = _from_rank0(lambda: checkpoint_problems(path, required_keys=required_keys), runtime)
    if problems == [f"no {COMPLETE_MARKER}"] or problems == ["not a directory"]:
        raise ConfigError("checkpoint.resume", f"{resume!r} is not a complete Tidal checkpoint (no {COMPLETE_MARKER})")
    if problems:
        raise ConfigError("checkpoint.resume", f"{resume!r} cannot be loaded: {'; '.join(problems)}")
    return [path]


def resolve_resume(
    resume: str, root: Path, *, runtime: Runtime | None = None, required_keys: tuple[str, ...] = REQUIRED_KEYS
) -> Path | None:
    """The checkpoint to resume from: ``auto`` -> the newest complete one that looks loadable (or
    None), ``never`` -> None, else the given directory (a ConfigError naming what is wrong when it
    does not look loadable). See :func:`resume_candidates`."""
    found = resume_candidates(resume, root, runtime=runtime, required_keys=required_keys)
    return found[0] if found else None


def load_resume(
    resume: str, root: Path, *, model_states: Callable[[], dict[str, Any]], rank: int, runtime: Runtime | None = None,
    required_keys: tuple[str, ...] = REQUIRED_KEYS, warn_skipped: bool = True,
) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
    """Resolve and load a resume (collective): ``(path, model_states, trainer_state)``, or None when
    there is nothing to resume. ``model_states()`` builds fresh state dicts to load into (called
    again for each attempt). A checkpoint is not taken when a file fails its checksum (rank 0
    reads them: :func:`checksum_problems`), when it fails to load on any rank, or when the loaded
    weights hold NaN/Inf on any rank (:func:`nonfinite_names`). Under ``auto`` such a checkpoint is
    skipped with a warning naming the problem, and the next older one is tried; an explicit path is
    a ConfigError at ``checkpoint.resume``. With ``runtime`` every rank takes the same decision.
    ``warn_skipped=False``: the checkpoints that fail the cheap checks were named already (by
    :func:`resolve_resume` at setup), so they are skipped without a second warning."""
    for path in resume_candidates(resume, root, runtime=runtime, required_keys=required_keys, warn=warn_skipped):
        states = model_states()
        error = _from_rank0(lambda: "; ".join(checksum_problems(path)) or None, runtime)  # the same on every rank
        if error is None:
            error = _load_problem(path, states, rank)
        if error is None if runtime is None else runtime.all_agree(error is None):
            return path, states, trainer_state_of(path)
        why = error or "it failed to load, or holds NaN/Inf, on another rank"
        if resume != "auto":
            raise ConfigError("checkpoint.resume", f"{resume!r} cannot be loaded: {why}")
        _warn(f"checkpoint.resume=auto skips {path}: {why}", runtime)
    return None


def _load_problem(path: Path, states: dict[str, Any], rank: int) -> str | None:
    """Load ``path`` into ``states`` (collective); what is wrong with it on this rank, or None."""
    try:
        load_checkpoint(path, model_states=states, rank=rank)
    except Exception as e:  # noqa: BLE001 -- reported and decided on by the caller, the same on every rank
        return f"loading failed: {error_summary(e.__cause__ if isinstance(e, CheckpointLoadError) and e.__cause__ else e)}"
    bad = nonfinite_names(states)
    return f"its weights hold NaN/Inf ({', '.join(bad)})" if bad else None


def trainer_state_of(path: Path) -> dict[str, Any]:
    """The trainer state (``trainer.json``) of checkpoint ``path``."""
    with open(path / COMPLETE_MARKER, encoding="utf-8") as f:
        return json.load(f)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_space_note(directory: Path) -> str:
    """How much space ``directory``'s filesystem has left, for the message of a failed write
    (``0.00 GiB were free on its filesystem -- the disk is full``: a full disk often shows only as
    a zip or safetensors writer's error)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "free space unknown"
    full = " -- the disk is full" if free < _FULL_DISK_BYTES else ""
    return f"{free / 2**30:.2f} GiB were free on its filesystem{full}"


def _save_failed(exc: BaseException, tmp: Path, *, step: int, rank: int) -> CheckpointSaveError:
    """The error to raise for a failed write; rank 0 removes the partial ``tmp`` at once, so a full
    disk gets its space back (DCP reports a shard failure on every rank after all have written)."""
    where = free_space_note(tmp.parent)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return CheckpointSaveError(f"saving checkpoint step {step} into {tmp} failed: {error_summary(exc)} ({where}); the previous checkpoint is intact")


def save_checkpoint(
    root: Path, step: int, *, model_states: dict[str, Any], trainer_state: dict[str, Any], runtime: Runtime, keep: int
) -> Path:
    """Collective: every rank calls it with its shards (ranks meet at ``runtime.barrier``). Returns
    the final directory."""
    rank = runtime.rank
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    error: OSError | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clean_partial(root)
            if final.exists():  # re-saving the same step (e.g. after a resume): replace atomically below
                shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:  # the folder made read-only, or removed, mid-run
            error = e
    _agree_or_fail(runtime, error, tmp, step)  # the ranks' barrier
    faults.hit("checkpoint/begin", step=step, rank=rank)
    try:
        dcp.save(model_states, checkpoint_id=str(tmp / "models"))
        faults.hit("checkpoint/shards", step=step, rank=rank)
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    except (Exception, CheckpointException) as e:
        raise _save_failed(e, tmp, step=step, rank=rank) from e
    runtime.barrier()
    if rank == 0:
        try:
            _finish(root, tmp, final, step, trainer_state)
        except OSError as e:
            error = e
    _agree_or_fail(runtime, error, tmp, step)
    if rank == 0:
        _rotate(root, keep, step)
    runtime.barrier()
    return final


def _agree_or_fail(runtime: Runtime, error: OSError | None, tmp: Path, step: int) -> None:
    """Collective: :class:`CheckpointSaveError` on every rank when rank 0's part of a save failed
    (``error``, on rank 0), naming it in one line; else the ranks' barrier."""
    if not runtime.all_agree(error is None):
        raise _save_failed(error or OSError("rank 0 could not write the checkpoint's folder"), tmp, step=step,
                           rank=runtime.rank) from error


def _finish(root: Path, tmp: Path, final: Path, step: int, trainer_state: dict[str, Any]) -> None:
    """Rank 0: the config record, checksums and marker into ``tmp``, then ``tmp`` renamed to ``final``."""
    if (root.parent / CONFIG_RECORD).is_file():  # what a resume compares its config with
        shutil.copyfile(root.parent / CONFIG_RECORD, tmp / CONFIG_RECORD)
    write_checksums(tmp)
    with open(tmp / COMPLETE_MARKER, "w") as f:
        json.dump({**trainer_state, FORMAT_KEY: FORMAT}, f)
        f.flush()
        os.fsync(f.fileno())
    faults.hit("checkpoint/marker", step=step, rank=0)
    if final.exists():
        final.rename(final.with_name(final.name + ".old"))
        faults.hit("checkpoint/swapped", step=step, rank=0)
    tmp.rename(final)
    faults.hit("checkpoint/renamed", step=step, rank=0)
    shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
    _fsync_dir(root)


def _rotate(root: Path, keep: int, step: int) -> None:
    """Rank 0: remove all but the ``keep`` newest complete checkpoints; one that cannot be removed
    (a folder made read-only) is kept, with a warning."""
    for old in complete_checkpoints(root)[:-keep]:
        try:
            trash = old.rename(old.with_name(old.name + ".del.tmp"))  # a half-deleted one never looks complete
        except OSError as e:
            print(f"[tidal] warning: cannot remove the old checkpoint {old} ({error_summary(e)}); it is kept",
                  file=sys.stderr, flush=True)
            continue
        faults.hit("checkpoint/rotating", step=step, rank=0)
        shutil.rmtree(trash, ignore_errors=True)


def load_checkpoint(path: Path, *, model_states: dict[str, Any], rank: int) -> dict[str, Any]:
    """Load shards into ``model_states`` in place (collective); restore this rank's RNG; return
    trainer state. Nothing in the checkpoint can run code (see the module docstring). A failure of
    DCP's load (on any rank: DCP gathers them) raises :class:`CheckpointLoadError` on every rank."""
    models = path / "models"
    try:
        dcp.load(model_states, storage_reader=SafeFileSystemReader(models), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:
        raise CheckpointLoadError(f"cannot load {models}: {error_summary(e)}") from e
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(load_rng_file(rng_file))
    return trainer_state_of(path)
