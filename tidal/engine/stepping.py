"""Stepping an incremental engine until enough is done: the one loop over ``add`` / ``step`` /
``abort`` that every caller of :class:`~tidal.engine.base.IncrementalEngine` runs.

:func:`run_steps` adds requests to an idle engine and steps it; three hooks say what a caller wants:

- ``on_finished(completion)``: called the moment a sequence finishes, in step order (within a step
  in the engine's order), so work on a completion (a reward, a tool call) starts while the others
  decode;
- ``stop(completions) -> bool``: the stop rule, asked before the first step (with ``[]``) and after
  every step (with the completions that finished in it, after their ``on_finished``); True ends
  the run and the unfinished requests are aborted. :class:`GroupsComplete` stops once enough
  GRPO groups are complete (partial rollout, over-sampling, the long-tail policy);
- ``feed() -> list[Request] | None``: called before every step; the requests it returns are added
  (a multi-turn rollout's next turns, a TP group's exchanged requests). ``None`` says nothing is
  pending outside the engine: the run then ends as soon as the engine has nothing unfinished;
  a list (even empty) keeps the run going while the engine is idle (the feeder waits for its work).

Without ``stop`` and ``feed`` every request runs to its end. The engine is idle when
:func:`run_steps` returns or raises (an exception aborts what is in flight). Under tensor
parallelism every TP rank calls it with the same requests and hooks that return the same values
on every rank (the engine returns the same completions on every rank at every step), so every rank
makes the same engine calls and stops at the same step.

What this module does not know: rewards, which groups a batch trains, staleness; the callers own
those (e.g. :class:`tidal.trainer.partial.LongTailRollout`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable, Hashable, Mapping, Sequence

from tidal.engine.base import Completion, IncrementalEngine, Request


@dataclasses.dataclass(kw_only=True)
class EngineRun:
    """What :func:`run_steps` gave. finished: the completions that finished, in step order (the order
    ``on_finished`` saw them). unfinished: the partial completions of the requests aborted at the
    end (``finish_reason="abort"``), in the order they were added. steps: engine steps run."""

    finished: list[Completion]
    unfinished: list[Completion]
    steps: int


def run_steps(
    engine: IncrementalEngine,
    requests: Sequence[Request] = (),
    *,
    on_finished: Callable[[Completion], None] | None = None,
    stop: Callable[[list[Completion]], bool] | None = None,
    feed: Callable[[], Sequence[Request] | None] | None = None,
) -> EngineRun:
    """Add ``requests`` to the idle ``engine`` and step it until ``stop`` says so, or until the
    engine has nothing unfinished and ``feed`` (if any) has nothing pending; then abort the rest
    (see the module docstring for the hooks). RuntimeError when the engine is not idle: the run
    aborts whatever is unfinished at its end."""
    if engine.has_unfinished():
        raise RuntimeError("run_steps needs an idle engine: it aborts whatever is unfinished at the end")
    finished: list[Completion] = []
    steps = 0
    try:
        if requests:
            engine.add(requests)
        done: list[Completion] = []
        while stop is None or not stop(done):
            more = feed() if feed is not None else None
            if more:
                engine.add(more)
            if not engine.has_unfinished():
                if more is None:
                    break
                done = []
                continue
            done = engine.step()
            steps += 1
            for c in done:
                finished.append(c)
                if on_finished is not None:
                    on_finished(c)
    except BaseException:
        engine.abort()  # leave the engine idle: the next run starts clean
        raise
    return EngineRun(finished=finished, unfinished=engine.abort(), steps=steps)


class GroupsComplete:
    """Stop rule for :func:`run_steps`: stop once each owner has ``needed`` more complete groups.

    A group (the requests sharing a ``group_id``) completes when all of its requests in
    ``requests`` have finished (members that finished earlier are the caller's to leave out).
    ``needed``: a count for all groups together, or one count per owner, with ``owner[group_id]``
    the owner of each group (e.g. the TP rank that brought it). ``completed``: the group ids that
    completed, in the order they completed (all groups, whatever their owner's count)."""

    def __init__(self, requests: Sequence[Request], needed: int | Mapping[Hashable, int],
                 owner: Mapping[int, Hashable] | None = None):
        missing = [r.request_id for r in requests if r.group_id is None]
        if missing:
            raise ValueError(f"GroupsComplete: requests {missing[:3]} have no group_id")
        if not isinstance(needed, Mapping):
            needed, owner = {None: needed}, None
        self.left = Counter(r.group_id for r in requests)
        self.owner = owner
        self.todo = {o: int(n) for o, n in needed.items() if n > 0}
        self.completed: list[int] = []

    def __call__(self, completions: list[Completion]) -> bool:
        for c in completions:
            self.left[c.group_id] -= 1
            if self.left[c.group_id] == 0:
                self.completed.append(c.group_id)
                o = self.owner[c.group_id] if self.owner is not None else None
                if o in self.todo:
                    self.todo[o] -= 1
                    if self.todo[o] == 0:
                        del self.todo[o]
        return not self.todo
