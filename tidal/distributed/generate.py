"""gather_and_generate: one generation call per rollout TP group (spec §2.2).

Each rank brings its own prompts. Inside its TP group the prompts are gathered with
``all_gather_object``, the group's engine generates the concatenation once (every TP rank runs the
same engine step on its weight shard), and each rank keeps the slice that belongs to its prompts.
Prompts with images carry their pixel inputs in ``mm_inputs`` (one entry per prompt, None for
text); they travel with their prompts and reach the engine only when some prompt has images.
"""

from __future__ import annotations

import torch.distributed as dist

from tidal.distributed.runtime import Runtime
from tidal.engine.base import Completion, RolloutEngine, SamplingParams


def gather_and_generate(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, runtime: Runtime,
    mm_inputs: list[dict | None] | None = None,
) -> list[Completion]:
    """Return this rank's ``len(prompts) * params.n`` completions (prompt-major)."""
    if runtime.tp_size == 1:
        return _generate(engine, prompts, params, mm_inputs)
    gathered: list[list[list[int]] | None] = [None] * runtime.tp_size
    dist.all_gather_object(gathered, prompts, group=runtime.tp_group)
    all_prompts = [p for part in gathered for p in part]
    all_mm = None
    if mm_inputs is not None and any(m is not None for m in mm_inputs):
        mm_parts: list[list | None] = [None] * runtime.tp_size
        dist.all_gather_object(mm_parts, mm_inputs, group=runtime.tp_group)
        all_mm = [m for part, prompts_part in zip(mm_parts, gathered) for m in (part or [None] * len(prompts_part))]
    outputs = _generate(engine, all_prompts, params, all_mm)
    start = sum(len(part) for part in gathered[: runtime.tp_rank]) * params.n
    return outputs[start : start + len(prompts) * params.n]


def _generate(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, mm_inputs) -> list[Completion]:
    if mm_inputs is not None and any(m is not None for m in mm_inputs):
        return engine.generate(prompts, params, mm_inputs=mm_inputs)
    return engine.generate(prompts, params)  # text: the plain protocol call every engine has
