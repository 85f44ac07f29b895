"""Tidal against TRL's GRPOTrainer, one GRPO iteration end to end: ``python bench/e2e_grpo.py ...``
is ``python -m bench.grpo e2e ...``. The code is the package :mod:`bench.grpo` (see bench/README.md);
the names below are re-exported for the other bench scripts that build their assets with this
module's helpers or score with ``e2e_grpo:tidal_reward`` (bench/ on ``sys.path``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.grpo.assets import build_model_dir, build_tokenizer, write_prompts  # noqa: E402,F401
from bench.grpo.e2e import main  # noqa: E402
from bench.grpo.record import git_commit  # noqa: E402,F401
from bench.grpo.rewards import bench_score, tidal_reward, trl_reward  # noqa: E402,F401
from bench.grpo.shapes import SHAPES, kv_bytes_per_token, param_count  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
