"""What a run tells about its directory at start: the resolved config written there, and where its
metrics and checkpoints go and how to watch it. Shared by every job (RL, reward model)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from tidal.trainer import checkpoint as ckpt


def announce_run_dir(cfg) -> None:
    """Write the resolved config (the root ``TidalConfig``) into the run directory as
    ``config.yaml`` and say where the run lives and how to watch it (call on the main rank)."""
    run_dir = Path(cfg.run.output_dir)
    config_path = run_dir / "config.yaml"
    tmp = config_path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, config_path)
    lines = [f"[tidal] run directory: {run_dir}", f"[tidal]   resolved config: {config_path}"]
    if "jsonl" in cfg.logging.backends:
        lines.append(f"[tidal]   metrics: {run_dir / 'metrics.jsonl'}")
    if cfg.checkpoint.every > 0 or cfg.checkpoint.at_end:
        lines.append(f"[tidal]   checkpoints: {ckpt.checkpoint_root(cfg.run.output_dir)}")
    watch = [f"tidal report {run_dir}"]
    if "tensorboard" in cfg.logging.backends:
        watch.insert(0, f"tensorboard --logdir {run_dir / 'tb'}")
    lines.append(f"[tidal]   watch: {'  |  '.join(watch)}")
    print("\n".join(lines), flush=True)
