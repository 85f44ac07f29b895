"""Generation inside a rollout TP group: every TP rank makes the same engine calls (spec §2.2).

Each rank brings its own prompts; the TP group's engine is one engine sharded over the group, so
every call must be made by every TP rank with the same arguments (the ranks run the same engine
step on their weight shards; TP rank 0 samples and broadcasts). Two entry points:

- :func:`gather_and_generate`: one call. The group's prompts are gathered, generated together
  once, and each rank keeps the slice of its own prompts.
- :class:`GroupGenerator`: rounds, for rollouts that make many calls whose number differs between
  ranks (multi-turn environments, :mod:`tidal.envs.rollout`). In each round every rank brings the
  batches it has ready (possibly none) and whether it still has work; the round gathers them over
  the group, merges the batches of all ranks that sample alike (same :class:`SamplingParams` but
  the seed) into one engine call each, in one order every rank derives from the same gathered
  list, and hands each rank its completions. A rank with nothing to decode still joins every
  round (with no batch), so the calls stay in lockstep; the group stops when no rank has work.
  Across DP groups nothing needs to agree: each TP group has its own engine.
- :meth:`GroupGenerator.exchange`: the continuous form, for an engine with incremental requests.
  Before every engine step each rank brings the requests it adds now (possibly none) and whether
  its environments are still working; every rank adds the gathered requests in rank order and
  steps the engine, so all ranks make the same ``add`` / ``step`` calls; the group stops when the
  engine has nothing unfinished and no rank has work.

Prompts with images carry their pixel inputs (one entry per prompt, None for text); they reach the
engine only when some prompt of a call has images. Control messages go over the TP group's gloo
twin (``Runtime.tp_cpu_group``), so a round costs no device synchronisation.

:func:`gather_and_generate` also takes per-sequence budgets (``max_new_tokens``, one per
sequence), which travel with their prompts. An engine with the incremental request API generates
each sequence as its own request with its own budget; another gets one call at the group's
largest budget, each completion cut at its own afterwards (a sample of the same distribution: no
token before the cut depends on the ones after it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tidal.distributed.runtime import Runtime
from tidal.engine.base import Completion, Request, RolloutEngine, SamplingParams, sequence_key, supports_incremental
from tidal.engine.stepping import run_steps

# How long a rank of a TP group (size > 1) with nothing to decode waits for its environments before
# it joins the next round: rounds are a gloo all-gather, so this bounds how long a peer that has
# turns ready waits for it, at the price of a few rounds per second while the whole group waits.
TP_POLL_S = 0.005

# GroupGenerator.round's hook: (batch index, sequence index in the batch, completion)
OnFinished = Callable[[int, int, "Completion"], None]


@dataclasses.dataclass(kw_only=True)
class GenerateBatch:
    """One engine call's worth of a rank's prompts: ``len(prompts) * params.n`` completions come back,
    prompt-major. ``mm_inputs``: one pixel-input dict (or None) per prompt, or None for all text.
    ``max_new_tokens``: None (every sequence gets ``params.max_new_tokens``) or one budget per
    sequence, prompt-major, each in ``1..params.max_new_tokens`` (:func:`check_budgets`).
    ``keys``: None, or one random-stream key per sequence, prompt-major (:attr:`Request.key`, e.g.
    the trajectory's :func:`~tidal.engine.base.sequence_key`); honoured by engines with incremental
    requests (the others key by the position in the call, as ``generate`` does)."""

    prompts: list[list[int]]
    params: SamplingParams
    mm_inputs: list[dict | None] | None = None
    max_new_tokens: list[int] | None = None
    keys: list[int] | None = None


@dataclasses.dataclass(kw_only=True)
class Exchange:
    """What one engine step's exchange gave this rank (continuous multi-turn rollouts): the new
    requests of every rank of the group, in rank order (every rank adds them, in this order),
    whether some rank still has environment calls pending, and the failures ranks announced."""

    requests: list[Request]
    group_busy: bool
    failures: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class Round:
    """What a round gave this rank: the completions of each of its batches (in order), whether
    some rank of the group still has work (False: every rank leaves the loop after this round), and
    the failures other ranks announced (every rank then raises)."""

    completions: list[list[Completion]]
    group_busy: bool
    failures: list[str] = dataclasses.field(default_factory=list)


class GroupGenerator:
    """Rounds of engine calls in lockstep over this rank's TP group (see the module docstring).

    ``poll_s``: how long the caller may wait for its own work before the next round when it has
    nothing to decode (None: until it has some; a group of one waits for nobody).
    """

    def __init__(self, engine: RolloutEngine, runtime: Runtime):
        self.engine = engine
        self.runtime = runtime
        self.group_size = runtime.tp_size
        self.rank = runtime.tp_rank if self.group_size > 1 else 0  # this rank's index in its TP group
        self.poll_s: float | None = TP_POLL_S if self.group_size > 1 else None

    def exchange(self, requests: list[Request], *, busy: bool, failure: str | None = None) -> Exchange:
        """Before each engine step of a continuous rollout (:mod:`tidal.envs.rollout`): every rank
        of the group brings the requests it adds now (possibly none; ids unique over the group),
        whether it has environment calls pending, and its failure if it is failing. Every rank then
        adds the same requests in the same order and steps the engine, so the group's engine calls
        stay identical. One gloo all-gather per step (``Runtime.tp_cpu_group``); none for a group of one."""
        if self.group_size == 1:
            return Exchange(requests=list(requests), group_busy=busy)
        parts, failures = self._gather(list(requests), busy, failure)
        if failures:
            return Exchange(requests=[], group_busy=False, failures=failures)
        return Exchange(requests=[r for p in parts for r in p[0]], group_busy=any(p[1] for p in parts))

    def _gather(self, work: list, busy: bool, failure: str | None) -> tuple[list[tuple], list[str]]:
        """Every rank's ``(work, busy, failure)`` over the group's gloo twin, in rank order, and the
        failures announced (named by global rank)."""
        parts = self.runtime.tp_gather_objects((work, busy, failure))
        return parts, [f"rank {self.runtime.tp_ranks[r]}: {p[2]}" for r, p in enumerate(parts) if p[2] is not None]

    def round(self, batches: list[GenerateBatch], *, busy: bool, failure: str | None = None,
              on_finished: OnFinished | None = None) -> Round:
        """Run this rank's ``batches`` (with every other rank's of the group). ``busy``: this rank
        has work after this round's completions are in (trajectories decoding or waiting).
        ``failure``: this rank is failing (it then brings no batch, and raises after the round); the
        others find the message in their round's ``failures`` and no engine call is made.
        ``on_finished(j, k, completion)``: called once for each of this rank's completions (batch
        ``j``, sequence ``k`` in it) with the completion the round returns: the moment it finishes
        on an engine with incremental requests (between engine steps, through
        :func:`~tidal.engine.stepping.run_steps`, so work on it overlaps the decode of the rest),
        when its call returns otherwise."""
        for b in batches:
            if b.max_new_tokens is not None:
                check_budgets(b.max_new_tokens, len(b.prompts) * b.params.n, b.params.max_new_tokens)
        if self.group_size == 1:
            out = []
            for j, b in enumerate(batches):
                hook = None if on_finished is None else (lambda k, c, j=j: on_finished(j, k, c))
                out.append(_generate(self.engine, b.prompts, b.params, b.mm_inputs, b.max_new_tokens, hook, b.keys))
            return Round(completions=out, group_busy=busy)
        parts, failures = self._gather([(b.prompts, b.params, b.mm_inputs, b.max_new_tokens, b.keys) for b in batches],
                                       busy, failure)
        if failures:
            return Round(completions=[[] for _ in batches], group_busy=False, failures=failures)
        mine: list[list[Completion]] = [[] for _ in batches]
        for params, owners in merge_batches([p[0] for p in parts]):
            prompts = [p for _, _, ps, *_ in owners for p in ps]
            spans, start = [], 0  # (rank, batch, first index in the merged call, end)
            for rank, j, ps, *_ in owners:
                spans.append((rank, j, start, start + len(ps) * params.n))
                start += len(ps) * params.n
            hook = None if on_finished is None else self._mine(spans, on_finished)
            outputs = _generate(self.engine, prompts, params, _merged_mm(owners), _merged_budgets(owners, params), hook,
                                _merged_keys(owners))
            for rank, j, lo, hi in spans:
                if rank == self.runtime.tp_rank:
                    mine[j] = outputs[lo:hi]
        return Round(completions=mine, group_busy=any(p[1] for p in parts))

    def _mine(self, spans: list[tuple[int, int, int, int]], on_finished: OnFinished):
        """A merged call's per-completion hook: ``on_finished(j, k, c)`` for this rank's completions only."""
        def hook(i: int, c: Completion) -> None:
            for rank, j, lo, hi in spans:
                if lo <= i < hi and rank == self.runtime.tp_rank:
                    on_finished(j, i - lo, c)
        return hook


def merge_batches(per_rank: list[list[tuple]]) -> list[tuple[SamplingParams, list[tuple]]]:
    """The engine calls of a round: batches (``(prompts, params, mm_inputs, budgets, keys)``, listed
    per rank) that differ at most in their seed share one call, in order of first appearance (rank,
    then batch); the call uses the first batch's parameters (its seed: only TP rank 0 samples).
    Returns ``[(params, [(rank, batch index, prompts, mm_inputs, budgets, keys), ...]), ...]``;
    deterministic, so every rank derives the same calls from the same gathered list."""
    calls: dict[SamplingParams, tuple[SamplingParams, list[tuple]]] = {}
    for rank, batches in enumerate(per_rank):
        for j, (prompts, params, mm, budgets, keys) in enumerate(batches):
            key = dataclasses.replace(params, seed=None)
            calls.setdefault(key, (params, []))[1].append((rank, j, prompts, mm, budgets, keys))
    return list(calls.values())


def _merged_mm(owners: list[tuple]) -> list[dict | None] | None:
    if all(mm is None for _, _, _, mm, _, _ in owners):
        return None
    return [m for _, _, ps, mm, _, _ in owners for m in (mm if mm is not None else [None] * len(ps))]


def _merged_budgets(owners: list[tuple], params: SamplingParams) -> list[int] | None:
    """The merged call's budgets: None when no batch has any, else each batch's own
    (``params.max_new_tokens`` for a batch without)."""
    if all(b is None for *_, b, _ in owners):
        return None
    return [x for _, _, ps, _, b, _ in owners for x in (b if b is not None else [params.max_new_tokens] * (len(ps) * params.n))]


def _merged_keys(owners: list[tuple]) -> list[int] | None:
    """The merged call's stream keys: None when no batch has any; else every batch must bring its
    own (a batch without would key by its position in the merged call and could meet another's)."""
    if all(k is None for *_, k in owners):
        return None
    if any(k is None for *_, k in owners):
        raise ValueError("a round merges batches with and without stream keys: give every batch its keys")
    return [x for *_, k in owners for x in k]


def gather_and_generate(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, runtime: Runtime,
    mm_inputs: list[dict | None] | None = None, max_new_tokens: list[int] | None = None,
) -> list[Completion]:
    """Return this rank's ``len(prompts) * params.n`` completions (prompt-major): one engine call
    for the whole TP group, every TP rank bringing its own prompts with the same ``params``.

    ``max_new_tokens``: None (every sequence gets ``params.max_new_tokens``) or one budget per
    sequence, prompt-major (``params.n`` per prompt), each in ``1..params.max_new_tokens``."""
    batch = GenerateBatch(prompts=prompts, params=params, mm_inputs=mm_inputs, max_new_tokens=max_new_tokens)
    return GroupGenerator(engine, runtime).round([batch], busy=False).completions[0]


def check_budgets(budgets: list[int], n_seqs: int, limit: int) -> None:
    """ValueError unless ``budgets`` has ``n_seqs`` entries, each in ``1..limit``."""
    if len(budgets) != n_seqs:
        raise ValueError(f"max_new_tokens: {len(budgets)} budgets for {n_seqs} sequences (one per sequence, prompt-major)")
    bad = [b for b in budgets if not 1 <= int(b) <= limit]
    if bad:
        raise ValueError(f"max_new_tokens: budgets must be in 1..{limit} (params.max_new_tokens), got {bad[:5]}")


def _generate(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, mm_inputs,
              budgets: list[int] | None = None, on_finished: Callable[[int, Completion], None] | None = None,
              keys: list[int] | None = None) -> list[Completion]:
    """The call's completions, prompt-major; ``on_finished(i, completion)`` once for each (see
    :meth:`GroupGenerator.round`); ``keys``: each sequence's stream key (engines with incremental
    requests)."""
    if (budgets is not None or on_finished is not None or keys is not None) and supports_incremental(engine):
        return _generate_requests(engine, prompts, params, mm_inputs, budgets, on_finished, keys)
    if budgets is not None:  # one call at the longest budget, each completion cut at its own
        longest = dataclasses.replace(params, max_new_tokens=max(budgets))
        out = [cut_to_budget(c, b) for c, b in zip(_generate(engine, prompts, longest, mm_inputs), budgets, strict=True)]
    elif mm_inputs is not None and any(m is not None for m in mm_inputs):
        out = engine.generate(prompts, params, mm_inputs=mm_inputs)
    else:
        out = engine.generate(prompts, params)  # text: the plain protocol call every engine has
    for i, c in enumerate(out if on_finished is not None else ()):
        on_finished(i, c)
    return out


def _generate_requests(engine, prompts: list[list[int]], params: SamplingParams, mm_inputs, budgets: list[int] | None,
                       on_finished: Callable[[int, Completion], None] | None, keys: list[int] | None = None
                       ) -> list[Completion]:
    """Prompt-major completions through the engine's request API, as its ``generate`` numbers them
    (request ``i``: sequence ``i``, group ``i // n``, stream key ``keys[i]`` or, as ``generate``
    keys it, ``sequence_key(i // n, i % n)``: then the same draws, the same completions), sequence
    i with ``max_new_tokens=budgets[i]`` when given (no step is spent past a sequence's budget);
    ``on_finished(i, completion)`` as each finishes."""
    n = params.n
    budgets = budgets if budgets is not None else [params.max_new_tokens] * (len(prompts) * n)
    # one dict per prompt, as generate makes them: the engine shares image features among the requests sharing a dict
    mm = [dict(m) if m is not None else None for m in mm_inputs] if mm_inputs is not None else None
    requests = [
        Request(request_id=i, prompt_ids=prompts[i // n], group_id=i // n,
                params=dataclasses.replace(params, n=1, max_new_tokens=b),
                mm_inputs=mm[i // n] if mm is not None else None,
                key=keys[i] if keys is not None else sequence_key(i // n, i % n))
        for i, b in enumerate(budgets)
    ]
    hook = None if on_finished is None else (lambda c: on_finished(c.request_id, c))
    out: list[Completion | None] = [None] * len(requests)
    for c in run_steps(engine, requests, on_finished=hook).finished:
        out[c.request_id] = c
    return out


def cut_to_budget(c: Completion, budget: int) -> Completion:
    """``c`` as generated with ``max_new_tokens=budget``: its first ``budget`` tokens, ``length`` (an
    MoE's routing of the tokens fed before them)."""
    if len(c.token_ids) <= budget:
        return c
    routed = c.routed_experts[: len(c.prompt_ids) + budget - 1] if c.routed_experts is not None else None
    return dataclasses.replace(c, token_ids=c.token_ids[:budget], logprobs=c.logprobs[:budget], finish_reason="length",
                               routed_experts=routed)


def force_end(c: Completion, budget: int, end_token_id: int) -> Completion:
    """``c`` ending with ``end_token_id`` (logprob 0.0, ``stop``) if it was cut at exactly ``budget``
    tokens (budget forcing: see :mod:`tidal.trainer.budget`)."""
    if c.finish_reason != "length" or len(c.token_ids) != budget:
        return c
    return dataclasses.replace(c, token_ids=[*c.token_ids[:-1], end_token_id], logprobs=[*c.logprobs[:-1], 0.0],
                               finish_reason="stop")
