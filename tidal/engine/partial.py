"""Partial rollout on an incremental engine: generate until enough groups are complete, keep the rest.

A GRPO group is the ``n`` samples of one prompt (requests sharing a ``group_id``). Heavy-tailed
generation lengths leave the device decoding a few long sequences at the end of every rollout;
partial rollout stops as soon as ``groups_needed`` groups are complete and hands back the unfinished
sequences as partial completions (tokens, logprobs and policy versions so far), which the next
iteration resumes under its new weights (:meth:`tidal.engine.base.Request.resume`). The same call
with more prompts than needed and the unfinished ones dropped is the simpler over-sampling scheme.

Under tensor parallelism every TP rank calls :func:`run_until_groups` with the same requests: the
engine returns the same completions on every rank at every step, so every rank stops at the same
step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

from tidal.engine.base import Completion, IncrementalEngine, Request


@dataclasses.dataclass
class PartialRollout:
    """finished: every completion that finished, in the order of the requests. unfinished: the
    partial completions of the others (``finish_reason="abort"``), in the order of the requests.
    complete_groups: the ids of the groups whose requests all finished, in the order they completed
    (at least ``groups_needed`` of them unless every request finished first)."""

    finished: list[Completion]
    unfinished: list[Completion]
    complete_groups: list[int]
    steps: int


def run_until_groups(engine: IncrementalEngine, requests: Sequence[Request], groups_needed: int | None = None
                     ) -> PartialRollout:
    """Add ``requests`` to an idle ``engine`` and step it until ``groups_needed`` groups are complete
    (a group is complete when all of its requests in ``requests`` finished; group members that
    finished in an earlier call are the caller's to count), then abort the rest. ``None`` runs every
    request to its end."""
    if engine.has_unfinished():
        raise RuntimeError("run_until_groups needs an idle engine: it aborts whatever is unfinished at the end")
    if groups_needed is not None:
        missing = [r.request_id for r in requests if r.group_id is None]
        if missing:
            raise ValueError(f"run_until_groups with groups_needed: requests {missing[:3]} have no group_id")
    left = Counter(r.group_id for r in requests)
    order = {r.request_id: i for i, r in enumerate(requests)}
    engine.add(requests)
    finished: list[Completion] = []
    complete: list[int] = []
    steps = 0
    while engine.has_unfinished() and (groups_needed is None or len(complete) < groups_needed):
        for c in engine.step():
            finished.append(c)
            left[c.group_id] -= 1
            if left[c.group_id] == 0 and c.group_id is not None:
                complete.append(c.group_id)
        steps += 1
    unfinished = engine.abort()
    finished.sort(key=lambda c: order[c.request_id])
    unfinished.sort(key=lambda c: order[c.request_id])
    return PartialRollout(finished=finished, unfinished=unfinished, complete_groups=complete, steps=steps)
