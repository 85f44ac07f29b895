"""``tidal train|eval|export`` for ``job: reward_model`` (dispatched from :func:`tidal.jobs.run_job`)."""

from __future__ import annotations

import json

from tidal.config_base import ConfigError


def run(cfg, command: str, *, checkpoint: str | None = None, out: str | None = None) -> int:
    """train: fit to ``run.steps``. eval: load ``checkpoint`` and print its eval metrics as one JSON
    line. export: load ``checkpoint`` and write the HF folder ``out``."""
    from tidal.distributed import shutdown
    from tidal.rm.export import export_reward_model
    from tidal.rm.setup import build_reward_model_trainer

    trainer = build_reward_model_trainer(cfg)
    try:
        if command == "train":
            trainer.fit()
        elif command == "eval":
            if not trainer.eval_pairs:
                raise ConfigError("data.eval", "tidal eval needs eval pairs (set data.eval)")
            step = trainer.resume()
            metrics = trainer.evaluate(step)
            if trainer.rt.is_main:
                print(json.dumps({"checkpoint": checkpoint, "step": step, **metrics}))
        elif command == "export":
            trainer.resume()
            export_reward_model(trainer, out)
        else:
            raise ValueError(f"unknown command {command!r}")
    finally:
        trainer.watchdog.close()
        shutdown()
    return 0
