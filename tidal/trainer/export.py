"""Export the trained actor as a Hugging Face folder (safetensors + config + tokenizer).

Where an export may write (:func:`check_export_target`): a new folder, an empty one, or one an
export wrote before (it holds :data:`EXPORT_MARKER`). Nothing else is ever deleted or overwritten,
and the run directory, its checkpoints and the model folder are refused even when empty of files
an export could clash with. The folder is written beside ``out`` under a fresh name and renamed
into place (:func:`write_export`), so a failed export leaves ``out`` as it was.
"""

from __future__ import annotations

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
from tidal.run.checkpoint import check_outside_checkpoints, error_summary, free_space_note

EXPORT_MARKER = ".tidal-export"  # in every folder an export wrote: a later export may replace it


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
    """Call ``write(folder)`` on a fresh folder beside ``out``, mark it (:data:`EXPORT_MARKER`,
    recording ``source``), make its files readable like any other (``umask``, not the 0600 of
    a temporary file), then put it in the place of ``out``: a folder ``out`` that was there (empty,
    or an earlier export: checked again here) is removed only after the new one is in place.
    Call :func:`check_export_target` first, on every rank (this runs on one)."""
    check_export_target(out, key=key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
    try:
        write(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"source": source, "written": time.strftime("%Y-%m-%d %H:%M:%S %z")}) + "\n")
        _chmod_like_umask(tmp)
        aside = None
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
            os.replace(out, aside / out.name)
        os.replace(tmp, out)
    except Exception as e:
        free = free_space_note(out.parent)  # before the partial copy gives its space back
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"writing the export {out} failed: {error_summary(e)} ({free}); "
                          f"{'the earlier export in it is' if out.exists() else 'it is'} as it was") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return out


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
