"""Export the trained actor as a Hugging Face folder (safetensors + config + tokenizer)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tidal.models.lora import save_hf


def export_hf(trainer, out_dir: str) -> Path:
    """Gather the actor's full weights (collective) and write ``out_dir`` on rank 0, atomically
    (written to ``out_dir.tmp`` then renamed). Loadable with ``AutoModelForCausalLM.from_pretrained``;
    a LoRA actor is written merged, with its adapters in PEFT format under ``out_dir/adapter``."""
    out = Path(out_dir)
    full_sd = trainer.phases.strategy.full_model_state_dict(trainer.models.actor.model)
    if trainer.rt.is_main:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(trainer.models.actor.model, full_sd, tmp)
        trainer.models.tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    trainer.rt.barrier()
    return out
