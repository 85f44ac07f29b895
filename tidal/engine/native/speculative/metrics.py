"""The ``rollout/spec_*`` metrics of a rollout, from :class:`~tidal.engine.native.NativeEngine`'s stats."""

from __future__ import annotations

import contextlib
from typing import Iterator

from tidal.engine.native.engine import NativeEngine
from tidal.engine.native.speculative import STAT_KEYS


def rollout_metrics(before: dict, after: dict) -> dict[str, float]:
    """The ``rollout/spec_*`` metrics of the steps between two snapshots of ``NativeEngine.stats``:
    ``acceptance_rate`` (kept / drafted tokens), ``accepted_per_verify`` (kept tokens per drafting
    sequence and verify), ``steps_frac`` (decode steps that verified drafts), ``verify_overhead``
    (rows computed by verify steps over the rows plain steps would have computed, minus 1) and
    ``tokens_per_step`` (tokens emitted per sequence per verify step)."""
    d = {k: after[k] - before[k] for k in (*STAT_KEYS, "decode_steps")}
    return {
        "rollout/spec_acceptance_rate": d["spec_accepted"] / max(1, d["spec_drafted"]),
        "rollout/spec_accepted_per_verify": d["spec_accepted"] / max(1, d["spec_seqs"]),
        "rollout/spec_steps_frac": d["spec_steps"] / max(1, d["decode_steps"]),
        "rollout/spec_verify_overhead": d["spec_rows"] / max(1, d["spec_plain_rows"]) - 1 if d["spec_steps"] else 0.0,
        "rollout/spec_tokens_per_step": (d["spec_plain_rows"] + d["spec_accepted"]) / max(1, d["spec_plain_rows"]),
    }


@contextlib.contextmanager
def speculation_metrics(engine) -> Iterator[dict[str, float]]:
    """Around a rollout: yields a dict that holds, on exit, the rollout's ``rollout/spec_*`` metrics
    (:func:`rollout_metrics`) when ``engine`` is a native engine that speculates; else it stays empty."""
    out: dict[str, float] = {}
    speculates = isinstance(engine, NativeEngine) and engine.spec.enabled
    before = dict(engine.stats) if speculates else None
    yield out
    if speculates:
        out.update(rollout_metrics(before, engine.stats))
