"""Export a trained reward model as a Hugging Face folder that an RL run loads as a reward component.

The folder holds the one-label sequence classifier (safetensors, ``config.json`` with its
``pad_token_id``), its tokenizer, and :data:`tidal.rewards.model.FORMAT_FILE`, which records how
the training texts were built, so that ``reward.components.X: {type: model, path: FOLDER}``
scores ``prompt + separator + response`` exactly as training did (see
:func:`tidal.rewards.model.resolve_separator`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tidal.models.lora import save_hf
from tidal.trainer.export import set_config_dtype, write_export
from tidal.rewards.model import FORMAT_FILE

FORMAT_VERSION = 1


def reward_format(cfg) -> dict:
    """What :data:`FORMAT_FILE` records for a run's config (the root ``TidalConfig``)."""
    return {
        "version": FORMAT_VERSION,
        "sequence": "prompt + separator + response",
        "separator": cfg.reward_model.separator,
        "prompt": "chat_template" if cfg.data.apply_chat_template else "raw",
        "system_prompt": cfg.data.system_prompt,
        "max_length": cfg.reward_model.max_length,
    }


def export_reward_model(trainer, out_dir: str | os.PathLike, dtype: torch.dtype | None = None, *, source: str = "",
                        key: str = "--out") -> Path:
    """Gather the full weights (a collective on every rank) and write ``out_dir`` on rank 0 through
    :func:`tidal.trainer.export.write_export` (``out_dir`` must pass
    :func:`~tidal.trainer.export.check_export_target`: new, empty or an earlier export). Returns the
    folder. Floating weights are written in ``dtype``, by default the dtype the model trained in
    (``strategy.param_dtype``), and ``config.json`` says so."""
    out = Path(out_dir).resolve()
    dtype = dtype or trainer.strategy.param_dtype
    full_sd = trainer.strategy.full_model_state_dict(trainer.model)
    full_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full_sd.items()}
    if trainer.rt.is_main:

        def write(folder: Path) -> None:
            save_hf(trainer.model, full_sd, folder)
            set_config_dtype(folder / "config.json", dtype)
            trainer.tokenizer.save_pretrained(folder)
            (folder / FORMAT_FILE).write_text(json.dumps(reward_format(trainer.cfg), indent=2))

        write_export(out, write, source=source, key=key)
    trainer.rt.barrier()
    return out


def export_summary(out: Path, dtype: torch.dtype, source: str) -> str:
    """The line that says what an export wrote, where, and from what (``source``: ``checkpoint P (step N)``)."""
    return (f"exported the reward model of {source} to {out.resolve()} (a Hugging Face sequence classifier folder: "
            f"weights in {str(dtype).removeprefix('torch.')}, config, tokenizer, {FORMAT_FILE}; an RL run scores "
            f"with it as reward.components.NAME: {{type: model, path: {out}}})")
