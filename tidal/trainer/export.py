"""Export the trained actor as a Hugging Face folder (safetensors + config + tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from tidal.models.lora import save_hf


def export_hf(trainer, out_dir: str, dtype: torch.dtype | None = None) -> Path:
    """Gather the actor's full weights (collective) and write ``out_dir`` on rank 0, atomically
    (written to ``out_dir.tmp`` then renamed). Loadable with ``AutoModelForCausalLM.from_pretrained``;
    a LoRA actor is written merged, with its adapters in PEFT format under ``out_dir/adapter``.
    Floating weights are written in ``dtype``, by default the dtype the model trained in
    (``strategy.param_dtype``: bf16 on CUDA, not the fp32 master copy), and ``config.json`` says so."""
    out = Path(out_dir)
    dtype = dtype or trainer.colocation.strategy.param_dtype
    full_sd = trainer.colocation.strategy.full_model_state_dict(trainer.models.actor.model)
    full_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full_sd.items()}
    if trainer.rt.is_main:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(trainer.models.actor.model, full_sd, tmp)
        set_config_dtype(tmp / "config.json", dtype)
        trainer.models.tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
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
