"""``tidal train|eval|export`` for ``job: reward_model`` (dispatched from :func:`tidal.jobs.run_job`)."""

from __future__ import annotations

import json

from tidal.config_base import ConfigError


def run(cfg, command: str, *, checkpoint: str | None = None, out: str | None = None, dtype: str | None = None) -> int:
    """train: fit to ``run.steps``. eval: load ``checkpoint`` and print its eval metrics as one JSON
    line. export: load ``checkpoint`` and write the HF folder ``out`` with weights in ``dtype`` (a
    torch dtype name; by default the dtype the model trained in). Each says what it loaded and wrote."""
    import torch

    from tidal.distributed import shutdown
    from tidal.logging.progress import stage
    from tidal.rm.export import export_reward_model, export_summary
    from tidal.rm.setup import build_reward_model_trainer

    trainer = build_reward_model_trainer(cfg, read_only=command != "train")
    try:
        if command == "train":
            trainer.fit()
        elif command == "eval":
            if not trainer.eval_pairs:
                raise ConfigError("data.eval", "tidal eval needs eval pairs (set data.eval)")
            step = trainer.resume()
            if trainer.rt.is_main:
                print(f"[tidal] evaluating the reward model of checkpoint {trainer.loaded_from} (step {step}) on "
                      f"{len(trainer.eval_pairs)} eval pairs", flush=True)
            metrics = trainer.evaluate(step)
            if trainer.rt.is_main:
                print(json.dumps({"checkpoint": checkpoint, "step": step, **metrics}))
        elif command == "export":
            step = trainer.resume()
            weights_dtype = getattr(torch, dtype) if dtype else trainer.strategy.param_dtype
            with stage(f"gathering and writing the weights to {out}", enabled=trainer.rt.is_main):
                folder = export_reward_model(trainer, out, weights_dtype, source=f"checkpoint {trainer.loaded_from} (step {step})")
            if trainer.rt.is_main:
                source = f"checkpoint {trainer.loaded_from} (step {step})"
                print(f"[tidal] {export_summary(folder, weights_dtype, source)}", flush=True)
        else:
            raise ValueError(f"unknown command {command!r}")
    finally:
        trainer.watchdog.close()
        shutdown()
    return 0
