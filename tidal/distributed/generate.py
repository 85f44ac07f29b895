"""gather_and_generate: one generation call per rollout TP group (spec §2.2).

Each rank brings its own prompts. Inside its TP group the prompts are gathered with
``all_gather_object``, the group's engine generates the concatenation once (every TP rank runs the
same engine step on its weight shard), and each rank keeps the slice that belongs to its prompts.
"""

from __future__ import annotations

import torch.distributed as dist

from tidal.distributed.runtime import Runtime
from tidal.engine.base import Completion, RolloutEngine, SamplingParams


def gather_and_generate(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, runtime: Runtime
) -> list[Completion]:
    """Return this rank's ``len(prompts) * params.n`` completions (prompt-major)."""
    if runtime.tp_size == 1:
        return engine.generate(prompts, params)
    gathered: list[list[list[int]] | None] = [None] * runtime.tp_size
    dist.all_gather_object(gathered, prompts, group=runtime.tp_group)
    all_prompts = [p for part in gathered for p in part]
    outputs = engine.generate(all_prompts, params)
    start = sum(len(part) for part in gathered[: runtime.tp_rank]) * params.n
    return outputs[start : start + len(prompts) * params.n]
