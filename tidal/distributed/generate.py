"""gather_and_generate: one generation call per rollout TP group (spec §2.2).

Each rank brings its own prompts. Inside its TP group the prompts are gathered with
``all_gather_object``, the group's engine generates the concatenation once (every TP rank runs the
same engine step on its weight shard), and each rank keeps the slice that belongs to its prompts.
Prompts with images carry their pixel inputs in ``mm_inputs`` (one entry per prompt, None for
text); they travel with their prompts and reach the engine only when some prompt has images.

Per-sequence budgets (``max_new_tokens``, one per sequence) travel with their prompts too. The
engine protocol's ``generate`` takes one :class:`SamplingParams` per call, so the call asks for the
largest budget of the TP group and each completion is cut at its own budget afterwards (a sample
of the same distribution as with its own ``max_new_tokens``: no token before the cut depends on the
ones after it).
The engine then decodes every sequence up to the longest budget, as a plain rollout at that
``max_new_tokens`` would; an engine with per-request budgets saves those steps.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from tidal.distributed.runtime import Runtime
from tidal.engine.base import Completion, Request, RolloutEngine, SamplingParams, supports_incremental


def gather_and_generate(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, runtime: Runtime,
    mm_inputs: list[dict | None] | None = None, max_new_tokens: list[int] | None = None,
) -> list[Completion]:
    """Return this rank's ``len(prompts) * params.n`` completions (prompt-major).

    ``max_new_tokens``: None (every sequence gets ``params.max_new_tokens``) or one budget per
    sequence, prompt-major (``params.n`` per prompt), each in ``1..params.max_new_tokens``."""
    if max_new_tokens is not None:
        check_budgets(max_new_tokens, len(prompts) * params.n, params.max_new_tokens)
    if runtime.tp_size == 1:
        return _generate(engine, prompts, params, mm_inputs, max_new_tokens)
    parts: list[tuple | None] = [None] * runtime.tp_size  # each rank's (prompts, budgets)
    dist.all_gather_object(parts, (prompts, max_new_tokens), group=runtime.tp_group)
    gathered = [part[0] for part in parts]
    all_prompts = [p for part in gathered for p in part]
    all_mm = None
    if mm_inputs is not None and any(m is not None for m in mm_inputs):
        mm_parts: list[list | None] = [None] * runtime.tp_size
        dist.all_gather_object(mm_parts, mm_inputs, group=runtime.tp_group)
        all_mm = [m for part, prompts_part in zip(mm_parts, gathered) for m in (part or [None] * len(prompts_part))]
    all_budgets = _group_budgets([part[1] for part in parts], gathered, params)
    outputs = _generate(engine, all_prompts, params, all_mm, all_budgets)
    start = sum(len(part) for part in gathered[: runtime.tp_rank]) * params.n
    return outputs[start : start + len(prompts) * params.n]


def check_budgets(budgets: list[int], n_seqs: int, limit: int) -> None:
    """ValueError unless ``budgets`` has ``n_seqs`` entries, each in ``1..limit``."""
    if len(budgets) != n_seqs:
        raise ValueError(f"max_new_tokens: {len(budgets)} budgets for {n_seqs} sequences (one per sequence, prompt-major)")
    bad = [b for b in budgets if not 1 <= int(b) <= limit]
    if bad:
        raise ValueError(f"max_new_tokens: budgets must be in 1..{limit} (params.max_new_tokens), got {bad[:5]}")


def _group_budgets(budgets: list[list[int] | None], prompts: list[list[list[int]]], params: SamplingParams) -> list[int] | None:
    """The TP group's budgets in the gathered prompts' order: None when no rank has any, else each
    rank's own (``params.max_new_tokens`` for a rank without)."""
    if all(b is None for b in budgets):
        return None
    return [x for b, p in zip(budgets, prompts) for x in (b if b is not None else [params.max_new_tokens] * (len(p) * params.n))]


def _generate(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, mm_inputs,
              budgets: list[int] | None = None) -> list[Completion]:
    if budgets is not None and supports_incremental(engine):  # one request per sequence, each its own budget
        return _generate_with_budgets(engine, prompts, params, mm_inputs, budgets)
    if budgets is not None:  # one call at the longest budget, each completion cut at its own
        longest = dataclasses.replace(params, max_new_tokens=max(budgets))
        return [cut_to_budget(c, b) for c, b in zip(_generate(engine, prompts, longest, mm_inputs), budgets, strict=True)]
    if mm_inputs is not None and any(m is not None for m in mm_inputs):
        return engine.generate(prompts, params, mm_inputs=mm_inputs)
    return engine.generate(prompts, params)  # text: the plain protocol call every engine has


def _generate_with_budgets(engine, prompts: list[list[int]], params: SamplingParams, mm_inputs,
                           budgets: list[int]) -> list[Completion]:
    """Prompt-major completions, sequence i generated with ``max_new_tokens=budgets[i]`` through the
    engine's request API (no step is spent past a sequence's budget)."""
    n = params.n
    requests = [
        Request(request_id=i, prompt_ids=prompts[i // n], group_id=i // n,
                params=dataclasses.replace(params, n=1, max_new_tokens=b),
                mm_inputs=mm_inputs[i // n] if mm_inputs is not None else None)
        for i, b in enumerate(budgets)
    ]
    out: list[Completion | None] = [None] * len(requests)
    engine.add(requests)
    try:
        while engine.has_unfinished():
            for c in engine.step():
                out[c.request_id] = c
    except BaseException:
        engine.abort()
        raise
    return out


def cut_to_budget(c: Completion, budget: int) -> Completion:
    """``c`` as generated with ``max_new_tokens=budget``: its first ``budget`` tokens, ``length``."""
    if len(c.token_ids) <= budget:
        return c
    return dataclasses.replace(c, token_ids=c.token_ids[:budget], logprobs=c.logprobs[:budget], finish_reason="length")
