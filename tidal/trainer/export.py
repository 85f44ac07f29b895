"""Export the trained actor as a Hugging Face folder (safetensors + config + tokenizer).

Where an export may write (:func:`check_export_target`): a new folder, an empty one, or one an
export wrote before (it holds :data:`EXPORT_MARKER`). Nothing else is ever deleted or overwritten,
and the run directory, its checkpoints and the model folder are refused even when empty of files
an export could clash with. The folder is written beside ``out`` under a fresh name and renamed
into place (:func:`write_export`), so a failed export leaves ``out`` as it was.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from tidal.config_base import ConfigError
from tidal.models.lora import save_hf
from tidal.run.checkpoint import check_outside_checkpoints, error_summary, file_crc32, free_space_note

EXPORT_MARKER = ".tidal-export"  # an export's manifest: {"source", "written", "files": {path: crc32}}
# (while an export replaces an earlier one, "files" maps a path to the list of crc32s it may have)


class ExportError(RuntimeError):
    """Writing an export failed; the message says why in one line (the cause, the free space left, a
    full disk named as such) and that ``out`` is as it was."""


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_export_target(out: str | os.PathLike, *, run_dir: str | os.PathLike | None = None,
                        protected: dict[str, str | os.PathLike] | None = None, key: str = "--out") -> Path:
    """``out`` resolved, or a ConfigError at ``key`` saying why an export may not write there:
    it is an existing file, a folder holding files that no export wrote (no :data:`EXPORT_MARKER`),
    inside any checkpoint (:func:`~tidal.run.checkpoint.check_outside_checkpoints`, the check
    ``run.output_dir`` gets too), the run directory ``run_dir`` (or a folder holding it; a new
    folder inside it is fine), or
    one of ``protected`` (``{what: path}``: a checkpoint, ``model.path``; neither inside one, nor
    a folder holding one)."""
    target = Path(out).expanduser().resolve()
    check_outside_checkpoints(out, key=key)
    if run_dir is not None and _within(Path(run_dir).resolve(), target):
        raise ConfigError(key, f"{out} is the run directory {run_dir} (or holds it): export into a new folder")
    for what, path in (protected or {}).items():
        path = Path(path).expanduser().resolve()
        if _within(target, path) or _within(path, target):
            raise ConfigError(key, f"{out} is {what} {path} (or inside or around it): export into a new folder")
    if target.exists() and not target.is_dir():
        raise ConfigError(key, f"{out} is a file: export into a new or empty folder")
    if target.is_dir() and any(target.iterdir()) and not (target / EXPORT_MARKER).is_file():
        raise ConfigError(key, f"{out} holds files that no export wrote (no {EXPORT_MARKER}); export into a new or "
                          "empty folder, or delete it yourself")
    return target


def write_export(out: Path, write: Callable[[Path], None], *, source: str, key: str = "--out") -> Path:
    """Call ``write(folder)`` on a fresh hidden folder beside ``out``, make its files readable like
    any other (``umask``, not the 0600 of a temporary file), then put them in ``out`` with their
    manifest (:data:`EXPORT_MARKER`: ``source``, when, and the crc32 of each file written).

    ``out`` new or empty: the folder is renamed into place. ``out`` an earlier export: only what
    that export wrote is replaced -- the files its manifest lists whose bytes still match -- and
    every other file stays (a model card, a ``gguf/`` the user added). A file the new export writes
    that is there but not such a file (added by hand, or a copied or planted marker that lists
    nothing of it) is refused before anything in ``out`` changes (:class:`ExportError`). Before
    any file is swapped the manifest is rewritten to say so: its ``source`` names the swap as
    unfinished (never the new export's source over old weights, nor the old one's over new weights)
    and it lists each file with both the bytes it had and the bytes it gets, so an export killed
    midway leaves a folder that says what it is and that the next export replaces. What a killed export left beside ``out``
    (its hidden ``.<name>.writing-*`` copy, a ``.<name>.replaced-*`` folder) is removed first.
    Call :func:`check_export_target` first, on every rank (this runs on one)."""
    check_export_target(out, key=key)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
    try:
        write(tmp)
        _chmod_like_umask(tmp)
        written = _sums(tmp)
        if out.is_dir() and any(out.iterdir()):
            _replace_in(out, tmp, written, source)
        else:
            _write_manifest(tmp, written, source)
            if out.exists():
                out.rmdir()  # empty
            os.replace(tmp, out)
    except Exception as e:
        free = free_space_note(out.parent)  # before the partial copy gives its space back
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ExportError):
            raise
        raise ExportError(f"writing the export {out} failed: {error_summary(e)} ({free}); "
                          f"{'the earlier export in it is' if out.exists() else 'it is'} as it was") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _sums(folder: Path) -> dict[str, str]:
    """``{path relative to folder: crc32}`` of every file under ``folder``, the manifest aside."""
    return {str(f.relative_to(folder)): file_crc32(f) for f in sorted(folder.rglob("*")) if f.is_file() and f.name != EXPORT_MARKER}


def _write_manifest(folder: Path, files: dict[str, str], source: str) -> None:
    tmp = folder / f"{EXPORT_MARKER}.tmp"
    tmp.write_text(json.dumps({"source": source, "written": time.strftime("%Y-%m-%d %H:%M:%S %z"), "files": files}) + "\n")
    _chmod_like_umask_file(tmp)
    os.replace(tmp, folder / EXPORT_MARKER)


def exported_files(out: Path) -> dict[str, str]:
    """The files of ``out`` an earlier export wrote and that are as it wrote them: those its manifest
    lists whose crc32 still matches (one of the crc32s it lists for a file during a swap; a marker
    without a list, or an unreadable one, names none). ``{path: its crc32}``."""
    manifest = _manifest(out)
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        return {}
    found = {}
    for rel, crcs in listed.items():
        path = out / rel
        if isinstance(rel, str) and _within(path.resolve(), out.resolve()) and path.is_file() and not path.is_symlink() \
                and (crc := file_crc32(path)) in (crcs if isinstance(crcs, list) else [crcs]):
            found[rel] = crc
    return found


def _manifest(out: Path) -> dict:
    try:
        manifest = json.loads((out / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _replace_in(out: Path, tmp: Path, written: dict[str, str], source: str) -> None:
    """Put the files of ``tmp`` (``written``) into the earlier export ``out`` (see :func:`write_export`)."""
    old = exported_files(out)
    clash = sorted(rel for rel in written if (out / rel).exists() and rel not in old)
    if clash:
        shown = ", ".join(clash[:5]) + (", ..." if len(clash) > 5 else "")
        raise ExportError(f"{out} holds {shown}, which no earlier export wrote (or was changed since; a marker that "
                          "does not list it proves nothing): nothing was changed; move it away or export into a new folder")
    swapping = {rel: sorted({c for c in (old.get(rel), written.get(rel)) if c}) for rel in old.keys() | written.keys()}
    was = _manifest(out).get("source", "an earlier export")
    _write_manifest(out, swapping, f"unfinished: an export of {source} was replacing the export of {was} here (its files are "
                                   "of either); export again")  # an export killed below leaves a folder that says so
    for rel in old.keys() - written.keys():
        (out / rel).unlink()
    for rel in written:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / rel, out / rel)
    for rel in sorted({str(Path(r).parent) for r in old} - {"."}, key=len, reverse=True):
        with contextlib.suppress(OSError):  # a folder of the earlier export left empty (not one holding the user's files)
            (out / rel).rmdir()
    _write_manifest(out, written, source)


def _remove_leftovers(out: Path) -> None:
    """Remove what a killed export left beside ``out``: its hidden copies (``.<name>.writing-*``,
    ``.<name>.replaced-*``; a whole model each)."""
    for p in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        kind = p.name[len(out.name) + 2:].split("-", 1)[0]
        if kind in ("writing", "replaced") and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def _chmod_like_umask_file(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _chmod_like_umask(folder: Path) -> None:
    """Files 0666 and folders 0777, less the process's umask (safetensors writes 0600 temporaries)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_hf(trainer, out_dir: str, dtype: torch.dtype | None = None, *, source: str = "") -> Path:
    """Gather the actor's full weights (collective) and write ``out_dir`` on rank 0 through
    :func:`write_export` (``out_dir`` must pass :func:`check_export_target`). Loadable with
    ``AutoModelForCausalLM.from_pretrained``; a LoRA actor is written merged, with its adapters in
    PEFT format under ``out_dir/adapter``. Floating weights are written in ``dtype``, by default the
    dtype the model trained in (``strategy.param_dtype``: bf16 on CUDA, not the fp32 master copy),
    and ``config.json`` says so. ``source``: what the weights are, recorded in the marker."""
    out = Path(out_dir).resolve()
    dtype = dtype or trainer.colocation.strategy.param_dtype
    full_sd = trainer.colocation.strategy.full_model_state_dict(trainer.models.actor.model)
    full_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full_sd.items()}
    if trainer.rt.is_main:

        def write(folder: Path) -> None:
            save_hf(trainer.models.actor.model, full_sd, folder)
            set_config_dtype(folder / "config.json", dtype)
            trainer.models.tokenizer.save_pretrained(folder)

        write_export(out, write, source=source)
    trainer.rt.barrier()
    return out


def set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """Write ``dtype`` into a saved ``config.json`` (``save_pretrained`` records the in-memory
    model's dtype, the fp32 master weights', not that of the tensors it was given)."""
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
