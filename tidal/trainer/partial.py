"""Long-tail handling of training rollouts (``rollout.partial.*``): partial rollout across
iterations (``carry``) and over-sampling with the slowest groups dropped (``drop``).

Heavy-tailed completion lengths leave the device decoding a few long sequences at the end of every
plain rollout. Here each rank keeps prompt groups in flight (G: its share of
``rollout.prompts_per_step``; ``ceil(G * (1 + oversample))``, or with ``oversample: auto`` a number
sized from the observed tail after every rollout) and a rollout stops at the engine step where G
groups are complete (all ``n_samples`` sequences of the prompt finished) and, in ``carry``, every
due group is complete (one whose oldest token would lag more than ``max_staleness`` if it were
trained later: so a sequence spans at most ``max_staleness + 1`` rollouts and is never thrown away).
The G groups trained are, in ``carry``, the complete groups with the oldest tokens first, in
``drop`` the first to complete; they enter the batch ordered by group id (oldest prompts first), so
a rollout that cuts nothing (``oversample: 0``) is exactly a plain rollout: the same requests in the
same order, the same seed, the same group ids, the same stream keys (a sequence draws from its group
and sample index, :func:`~tidal.engine.base.sequence_key`, in a plain rollout as here, so a carried
sequence keeps its stream across rollouts).

``carry``: what is left (unfinished sequences with their tokens, sampling logprobs and per-token
policy versions, finished members of incomplete groups, complete groups beyond G) is kept by
:class:`LongTailRollout`, checkpointed (:meth:`LongTailRollout.state_dict`), and resumed first in
the next rollout: unfinished sequences are re-prefilled under the new weights
(:meth:`tidal.engine.base.Request.resume`) and go on. New prompts refill the in-flight groups. At
the start of a rollout, a carried sequence whose oldest token lags the engine's policy version by
more than ``max_staleness`` is restarted from its prompt, so no trained token lags more than that.

Multi turn (``env``: the run's :class:`~tidal.envs.rollout.EnvRollout`): the same groups, rule and
choice, the difference being data: a group member is a trajectory
(:class:`~tidal.envs.rollout.InFlightTrajectories`, whose environments, pool and tool calls live
across rollouts) and it is done when its trajectory ended, not when a sequence finished. A turn cut
by a rollout's end resumes with its tokens; a trajectory waiting for its tool at the end waits on
while the trainer trains. When the engine would idle (every trajectory waits for its tool), a new
group starts (one at a time: each carried trajectory is prefilled again in the next rollout, so
no more start than fill the gap), within the cap (:func:`max_in_flight` with ``oversample: auto``; a fixed
``oversample`` keeps its number). A :class:`SeqState` then mirrors its trajectory (the policy
versions of its sampled tokens, its finish) after each rollout; restarting one starts a fresh
trajectory from the prompt. Checkpoints keep the groups as fresh ones (an environment's state is
not saved). docs/agentic.md ("Trajectories in flight across rollouts").

``drop``: every rollout starts ``in_flight`` fresh groups; those not among the first G complete are
aborted and discarded (``partial/dropped_groups``). Nothing is stale, the batch is biased towards
short responses.

Under tensor parallelism the TP group's ranks share one engine: each rank brings its own groups,
the requests are gathered over the group (as :class:`~tidal.distributed.generate.GroupGenerator`
does) and every rank makes the same engine calls, stepping until every rank of the group has its G
complete groups; each rank keeps its own.

Metrics (per rank, averaged over ranks; ``_max`` ones the max): ``partial/staleness_mean`` and
``partial/staleness_max`` (policy versions a trained token lags the weights it is trained with),
``partial/stale_token_frac``, ``partial/span_mean`` / ``partial/span_max`` (rollouts a trained
sequence spanned, 1 for one that started and finished in this rollout), ``partial/resumed``
(unfinished sequences resumed with tokens), ``partial/restarted`` (sequences restarted: past
``max_staleness``), ``partial/carried`` (unfinished sequences carried to the next rollout),
``partial/carried_groups``, ``partial/carried_complete_groups``, ``partial/dropped_groups``
(``drop``), ``partial/new_groups``, ``partial/engine_steps``, ``partial/in_flight``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Callable, Sequence

from tidal.distributed.generate import force_end
from tidal.engine.base import Completion, IncrementalEngine, Request, SamplingParams, require_incremental, sequence_key
from tidal.engine.stepping import EngineRun, GroupsComplete, run_steps
from tidal.envs.base import EnvRow
from tidal.envs.rollout import EnvRollout, InFlightTrajectories
from tidal.envs.trajectory import Trajectory, TrajectoryBuilder
from tidal.trainer.config import SAMPLE_SLOTS, PartialRolloutConfig
from tidal.trainer.experience import first_group_id


AUTO_OVERSAMPLE = 0.5  # oversample: auto starts with ceil(1.5 G) groups in flight (drop keeps that)


def in_flight_groups(groups_per_step: int, oversample: float | str) -> int:
    """Groups a rank keeps in flight at first: ``ceil(G * (1 + oversample))`` (float noise rounded
    away; ``auto`` starts from :data:`AUTO_OVERSAMPLE`)."""
    extra = AUTO_OVERSAMPLE if oversample == "auto" else float(oversample)
    return max(groups_per_step, math.ceil(round(groups_per_step * (1.0 + extra), 6)))


def max_in_flight(groups_per_step: int, max_staleness: int) -> int:
    """The most groups ``oversample: auto`` keeps in flight: a group lives at most
    ``max_staleness + 1`` rollouts, so ``G * (max_staleness + 2)`` covers a full pipeline plus the
    complete groups waiting for a batch."""
    return groups_per_step * (max_staleness + 2)


@dataclasses.dataclass(kw_only=True)
class SeqState:
    """One sequence of a group in flight. ``finish_reason`` None: unfinished (``token_ids`` may
    hold tokens sampled so far). ``versions[i]``: the policy version that sampled ``token_ids[i]``.
    ``budget``: its ``max_new_tokens`` (resumed tokens included). ``start_step``: the step whose
    rollout started it (or restarted it)."""

    budget: int
    start_step: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def restart(self, step: int) -> None:
        self.token_ids, self.logprobs, self.versions, self.finish_reason, self.start_step = [], [], [], None, step

    def take(self, c: Completion) -> None:
        self.token_ids, self.logprobs = list(c.token_ids), list(c.logprobs)
        self.versions = list(c.versions) if c.versions is not None else [0] * len(c.token_ids)
        self.finish_reason = None if c.finish_reason == "abort" else c.finish_reason


@dataclasses.dataclass(kw_only=True)
class GroupState:
    """A prompt group in flight: the dataset row ``index`` and its ``n_samples`` sequences."""

    gid: int
    index: int
    seqs: list[SeqState]

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.seqs)

    def oldest_version(self, version: int) -> int:
        """The policy version of the group's oldest token (``version``, the engine's now, for a
        group without tokens: its first token will be sampled by it)."""
        return min((min(s.versions) for s in self.seqs if s.versions), default=version)

    def due(self, version: int, max_staleness: int) -> bool:
        """The group must be complete at the end of this rollout: trained any later (by version
        ``version + 1`` or newer) its oldest token would lag more than ``max_staleness``."""
        return version + 1 - self.oldest_version(version) > max_staleness


@dataclasses.dataclass(frozen=True)
class _Member:
    """A multi-turn group member as :class:`DueGroupsComplete` counts it (its trajectory's end
    plays a sequence's completion: both carry ``group_id``)."""

    request_id: int
    group_id: int


class DueGroupsComplete:
    """Stop rule for :func:`~tidal.engine.stepping.run_steps` under ``carry``: each owner has its
    complete groups (:class:`~tidal.engine.stepping.GroupsComplete`) and every ``due`` group is
    complete. :meth:`completed_when_due` counts an owner's groups that had completed in this run
    when the last due group did (the moment the rule would have stopped had enough groups been
    complete; the end of the run when that never came)."""

    def __init__(self, requests: Sequence[Request], needed: dict[int, int], owner: dict[int, int], due: Sequence[int]):
        self.enough = GroupsComplete(requests, needed, owner)
        self.owner = owner
        self.waiting = {g for g in due if self.enough.left[g] > 0}
        self.at_due: int | None = None  # completions counted when the last due group completed

    @property
    def completed(self) -> list[int]:
        return self.enough.completed

    def __call__(self, completions: list[Completion]) -> bool:
        enough = self.enough(completions)
        self.waiting = {g for g in self.waiting if self.enough.left[g] > 0}
        if not self.waiting and self.at_due is None:
            self.at_due = len(self.enough.completed)
        return enough and not self.waiting

    def completed_when_due(self, owner: int) -> int:
        done = self.enough.completed if self.at_due is None else self.enough.completed[: self.at_due]
        return sum(self.owner[g] == owner for g in done)


class LongTailRollout:
    """One rank's groups in flight and its policy (see the module docstring).

    ``dataset[i]``: a prompt item (``prompt_ids``, ``mm_inputs``, ...); ``draw()``: the next batch of
    dataset indices from the rank's sampler (drawn indices not started yet wait in a queue, which
    the checkpoint keeps). ``runtime``: the :class:`~tidal.distributed.runtime.Runtime` (its TP group's gather).
    """

    def __init__(self, cfg: PartialRolloutConfig, *, groups_per_step: int, n_samples: int, rank: int, runtime: Any,
                 dataset: Any, draw: Callable[[], list[int]], env: EnvRollout | None = None):
        if not cfg.enabled:
            raise ValueError("LongTailRollout needs rollout.partial.mode carry or drop")
        self.cfg = cfg
        self.G, self.n, self.rank = groups_per_step, n_samples, rank
        self.in_flight = in_flight_groups(groups_per_step, cfg.oversample)
        self.adaptive = cfg.mode == "carry" and cfg.oversample == "auto"
        self.cap = max_in_flight(groups_per_step, cfg.max_staleness) if self.adaptive else self.in_flight
        self.runtime, self.dataset, self.draw = runtime, dataset, draw
        self.groups: list[GroupState] = []  # carried over (carry mode), oldest first
        self.queue: list[int] = []  # drawn dataset indices not started yet
        # multi-turn (env: the rollout's environments): the trajectories in flight, made at the first rollout
        self.env = env
        self.inflight: InFlightTrajectories | None = None
        self.started = 0  # groups started by the current step (their ids follow first_group_id's)

    # ---- one rollout -------------------------------------------------------------------------------
    def collect(self, engine: Any, step: int, params: SamplingParams, budget: Any = None
                ) -> tuple[list[GroupState], dict[str, float], int]:
        """Run step ``step``'s rollout on the awake ``engine``; returns the G trained groups (by group
        id), the ``partial/*`` metrics and the policy version they are trained with. ``budget``: a
        :class:`~tidal.trainer.budget.CompletionBudget` for the new groups' sequences."""
        engine = require_incremental(engine, f"rollout.partial.mode={self.cfg.mode}")
        version = int(engine.policy_version)
        stats = Counter()
        self.started = 0
        self._restart_stale(version, step, stats)
        new = self._refill(step, params, budget)
        groups = self.groups + new
        before = sum(g.complete for g in groups)
        if self.env is not None:
            run, rule = self._run_env(engine, groups, step, params, version, stats)
        else:
            run, rule = self._run_sequences(engine, groups, params, version, budget, stats)
        stats["new_groups"] = self.started
        trained = self._choose(groups, rule.completed, version)
        chosen = {g.gid for g in trained}
        rest = [g for g in groups if g.gid not in chosen]
        if self.cfg.mode == "carry":
            self.groups = rest
            stats["carried_groups"] = len(rest)
            stats["carried"] = sum(not s.finished for g in rest for s in g.seqs)
            stats["carried_complete_groups"] = sum(g.complete for g in rest)
        else:
            self.groups = []
            stats["dropped_groups"] = len(rest)
        stats["engine_steps"] = run.steps
        stats["in_flight"] = self.in_flight
        if self.adaptive:
            self._adapt(before + rule.completed_when_due(self.runtime.tp_rank))
        return trained, self._metrics(trained, version, step, stats), version

    def _choose(self, groups: list[GroupState], completed: list[int], version: int) -> list[GroupState]:
        """The G groups to train, by group id: in ``carry``, the complete groups with the oldest
        tokens first (so a complete group never waits past ``max_staleness``), ties in the order
        they completed (groups complete before this run first); in ``drop``, the first G to complete."""
        by_gid = {g.gid: g for g in groups}
        now = set(completed)
        order = [g.gid for g in groups if g.complete and g.gid not in now]  # complete before this run
        order += [gid for gid in completed if gid in by_gid]
        if self.cfg.mode == "carry":
            rank = {gid: i for i, gid in enumerate(order)}
            order.sort(key=lambda gid: (by_gid[gid].oldest_version(version), rank[gid]))
        return sorted((by_gid[g] for g in order[: self.G]), key=lambda g: g.gid)

    def _adapt(self, complete_when_due: int) -> None:
        """``oversample: auto``: size the groups in flight from the observed tail. The rollout may
        stop once its due groups are complete; if fewer than G groups were complete then, it had
        to wait for more (the tail): keep more groups in flight (at most G/4 more per rollout); if
        many more were, keep fewer (half the excess), between G and :func:`max_in_flight`."""
        short = self.G - complete_when_due
        if short > 0:
            self.in_flight = min(self.cap, self.in_flight + min(short, -(-self.G // 4)))
        elif short < 0:
            self.in_flight = max(self.G, self.in_flight - (-short) // 2)

    def _run_sequences(self, engine: IncrementalEngine, groups: list[GroupState], params: SamplingParams, version: int,
                       budget: Any, stats: Counter) -> tuple[EngineRun, GroupsComplete | DueGroupsComplete]:
        """Single turn: the groups' unfinished sequences as requests (resumed with their tokens), run
        until the stop rule; each sequence takes its completion (finished or cut)."""
        requests = self._requests(groups, params, stats)
        run, rule = self._run(engine, groups, requests, version)
        by_gid = {g.gid: g for g in groups}
        end = budget.end_token_id if budget is not None else None
        for c in run.finished + run.unfinished:
            if c.group_id in by_gid:
                seq = by_gid[c.group_id].seqs[int(c.request_id) % SAMPLE_SLOTS]
                seq.take(force_end(c, seq.budget, end) if end is not None else c)
        return run, rule

    def _run_env(self, engine: IncrementalEngine, groups: list[GroupState], step: int, params: SamplingParams,
                 version: int, stats: Counter) -> tuple[EngineRun, DueGroupsComplete]:
        """Multi turn: the groups' trajectories (:class:`~tidal.envs.rollout.InFlightTrajectories`)
        go on, those without one (new, restarted, or resumed from a checkpoint) start from their
        prompt, until the same stop rule as single turn holds, counted on ended trajectories
        instead of finished sequences. When the engine would idle (every trajectory waits for its
        tool), a new group starts, within the in-flight cap: such groups are carried to later rollouts."""
        if self.inflight is None:
            self.inflight = InFlightTrajectories(self.env, params)
        for g in groups:
            for j, s in enumerate(g.seqs):
                key = g.gid * SAMPLE_SLOTS + j
                stats["resumed"] += key in self.inflight and not s.finished
                if key not in self.inflight:
                    self.inflight.start(key, EnvRow.from_prompt_item(self.dataset[g.index]), g.gid, j, params.seed)
        done = sum(g.complete for g in groups)
        due = [g.gid for g in groups if not g.complete and g.due(version, self.cfg.max_staleness)]
        members = [_Member(request_id=g.gid * SAMPLE_SLOTS + j, group_id=g.gid) for g in groups for j, s in enumerate(g.seqs)
                   if not s.finished]
        rule = DueGroupsComplete(members, {0: max(self.G - done, 0)}, {g.gid: 0 for g in groups}, due)
        ended: list[Trajectory] = []

        def admit() -> None:  # the engine would idle: one new group (the least work that fills it), within the cap
            fresh = self._new_groups(min(1, self.cap - len(groups)), step, params, None)
            for g in fresh:
                for j in range(self.n):
                    self.inflight.start(g.gid * SAMPLE_SLOTS + j, EnvRow.from_prompt_item(self.dataset[g.index]), g.gid, j,
                                        params.seed)
            groups.extend(fresh)

        def stop() -> bool:
            out, ended[:] = rule(ended), []
            return out

        run = self.inflight.collect(engine, params, stop=stop, admit=admit,
                                    on_trajectory=lambda key, t: ended.append(t))
        for g in groups:  # each sequence: its trajectory's sampled versions so far, finished once it ended
            for j, s in enumerate(g.seqs):
                key = g.gid * SAMPLE_SLOTS + j
                s.versions = self.inflight.versions(key)
                result = self.inflight.result(key)
                s.finish_reason = result.finish_reason if result is not None else None
        return run, rule

    def _restart_stale(self, version: int, step: int, stats: Counter) -> None:
        for g in self.groups:
            for j, s in enumerate(g.seqs):
                if s.versions and version - min(s.versions) > self.cfg.max_staleness:
                    s.restart(step)
                    if self.inflight is not None:  # multi turn: a fresh trajectory from the prompt
                        self.inflight.drop([g.gid * SAMPLE_SLOTS + j])
                    stats["restarted"] += 1

    def _refill(self, step: int, params: SamplingParams, budget: Any) -> list[GroupState]:
        """New groups for the free in-flight slots, from the queue of drawn indices."""
        return self._new_groups(self.in_flight - len(self.groups), step, params, budget)

    def _new_groups(self, need: int, step: int, params: SamplingParams, budget: Any) -> list[GroupState]:
        """``need`` new groups from the queue of drawn indices (their ids follow the step's earlier ones)."""
        need = max(need, 0)
        while len(self.queue) < need:
            self.queue += [int(i) for i in self.draw()]
        idx, self.queue = self.queue[:need], self.queue[need:]
        budgets = [params.max_new_tokens] * (need * self.n)
        if budget is not None and need:
            budgets = budget.budgets([self.dataset[i] for i in idx], params)
        # carried groups were started by earlier steps: these ids are free (at most cap new ones per step)
        first = first_group_id(step, self.rank, self.cap) + self.started
        self.started += need
        return [GroupState(gid=first + k, index=i,
                           seqs=[SeqState(budget=budgets[k * self.n + s], start_step=step) for s in range(self.n)])
                for k, i in enumerate(idx)]

    def _requests(self, groups: list[GroupState], params: SamplingParams, stats: Counter) -> list[Request]:
        out = []
        for g in groups:
            item = self.dataset[g.index]
            for j, s in enumerate(g.seqs):
                if s.finished:
                    continue
                stats["resumed"] += bool(s.token_ids)
                out.append(Request(request_id=g.gid * SAMPLE_SLOTS + j, prompt_ids=list(item.prompt_ids), group_id=g.gid,
                                   params=dataclasses.replace(params, n=1, max_new_tokens=s.budget),
                                   mm_inputs=item.mm_inputs, token_ids=list(s.token_ids), logprobs=list(s.logprobs),
                                   versions=list(s.versions), key=sequence_key(g.gid, j)))
        return out

    def _run(self, engine: IncrementalEngine, groups: list[GroupState], requests: list[Request], version: int
             ) -> tuple[EngineRun, GroupsComplete | DueGroupsComplete]:
        """The engine run of this rank's requests with the other TP ranks' (gathered in TP rank
        order: every rank makes the same calls), until every rank has its G complete groups and, in
        ``carry``, every rank's due groups are complete."""
        done = sum(g.complete for g in groups)
        due = [g.gid for g in groups if self.cfg.mode == "carry" and not g.complete and g.due(version, self.cfg.max_staleness)]
        mine = (requests, [g.gid for g in groups], max(self.G - done, 0), due)
        parts = self.runtime.tp_gather_objects(mine)
        all_requests = [r for reqs, _, _, _ in parts for r in reqs]
        owner = {gid: o for o, (_, gids, _, _) in enumerate(parts) for gid in gids}
        needed = {o: p[2] for o, p in enumerate(parts)}
        if self.cfg.mode == "carry":
            rule = DueGroupsComplete(all_requests, needed, owner, [gid for _, _, _, d in parts for gid in d])
        else:
            rule = GroupsComplete(all_requests, needed, owner)
        return run_steps(engine, all_requests, stop=rule), rule

    # ---- metrics -------------------------------------------------------------------------------------
    def _metrics(self, trained: list[GroupState], version: int, step: int, stats: Counter) -> dict[str, float]:
        lags = [version - v for g in trained for s in g.seqs for v in s.versions]
        spans = [step - s.start_step + 1 for g in trained for s in g.seqs]
        out = {
            "partial/staleness_mean": sum(lags) / max(len(lags), 1),
            "partial/staleness_max": float(max(lags, default=0)),
            "partial/stale_token_frac": sum(x > 0 for x in lags) / max(len(lags), 1),
            "partial/span_mean": sum(spans) / max(len(spans), 1),
            "partial/span_max": float(max(spans, default=0)),
        }
        keys = ("resumed", "restarted", "carried", "carried_groups", "carried_complete_groups", "new_groups", "engine_steps",
                "in_flight") if self.cfg.mode == "carry" else ("new_groups", "dropped_groups", "engine_steps", "in_flight")
        out.update({f"partial/{k}": float(stats[k]) for k in keys})
        return out

    # ---- trajectories --------------------------------------------------------------------------------
    def trajectories(self, trained: list[GroupState], decode: Callable[[list[list[int]]], list[str]]
                     ) -> tuple[list[Any], list[Trajectory]]:
        """The trained groups' trajectories (group-major, ``n`` each) and their prompt items. Single
        turn: built from the sequences exactly as the ``single_turn`` environment builds them; multi
        turn: the trajectories that ended (their environments are closed)."""
        items = [self.dataset[g.index] for g in trained]
        if self.inflight is not None:
            keys = [g.gid * SAMPLE_SLOTS + j for g in trained for j in range(self.n)]
            out = [self.inflight.result(k) for k in keys]
            self.inflight.drop(keys)
            return items, out
        texts = decode([s.token_ids for g in trained for s in g.seqs])
        out = []
        for g, item in zip(trained, items):
            row = EnvRow.from_prompt_item(item)
            for s in g.seqs:
                b = TrajectoryBuilder(list(row.prompt_ids), list(row.messages or []))
                b.add_turn(list(s.token_ids), list(s.logprobs), s.finish_reason, texts[len(out)])
                out.append(b.finish(row=row, group_id=g.gid, finish_reason="done"))
        return items, out

    # ---- checkpoint ----------------------------------------------------------------------------------
    def env_metrics(self, trained: list[GroupState]) -> dict[str, float]:
        """Multi turn: the ``env/*`` metrics of the trained groups' trajectories (call before
        :meth:`trajectories`), with the last rollout's timings (``env/wait_s``, ``env/generate_s``,
        ``env/generate_calls``); {} for single turn."""
        if self.inflight is None:
            return {}
        return self.inflight.metrics([g.gid * SAMPLE_SLOTS + j for g in trained for j in range(self.n)])

    def close(self) -> None:
        """Close the environments of the trajectories in flight (multi turn)."""
        if self.inflight is not None:
            self.inflight.close()

    def state_dict(self) -> dict:
        """The carried groups and the queue of drawn indices (JSON-serialisable). Multi turn: an
        environment's state cannot be saved, so the groups are saved as fresh ones (a resumed run
        starts their trajectories again from their prompts, ``partial/restarted``)."""
        groups = self.groups
        if self.env is not None:
            groups = [GroupState(gid=g.gid, index=g.index, seqs=[SeqState(budget=s.budget, start_step=s.start_step) for s in g.seqs])
                      for g in groups]
        return {"groups": [dataclasses.asdict(g) for g in groups], "queue": list(self.queue),
                "in_flight": self.in_flight}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive:  # sized from the observed tail: the checkpoint's size goes on
            self.in_flight = min(int(state["in_flight"]), self.cap)
        elif int(state["in_flight"]) != self.in_flight:
            raise ValueError(f"the checkpoint's partial rollout kept {state['in_flight']} groups in flight per rank, this "
                             f"run keeps {self.in_flight} (rollout.prompts_per_step, rollout.partial.oversample and the "
                             f"world size must match to resume exactly)")
        self.groups = [GroupState(gid=int(g["gid"]), index=int(g["index"]), seqs=[SeqState(**s) for s in g["seqs"]])
                       for g in state["groups"]]
        if self.inflight is not None:  # multi turn: the loaded groups' trajectories start from their prompts
            self.inflight.close()
            self.inflight = None
        self.queue = [int(i) for i in state["queue"]]


def per_rank_states(states: Sequence[dict], rank: int, world_size: int) -> dict | None:
    """This rank's entry of the checkpoint's per-rank partial rollout states; None when they were
    saved on another number of ranks (a resume on a new topology): each rank's groups in flight were
    sized for its share of the batch and hold its own engine's sequences, so they are not dealt out
    again but dropped (:func:`dropped_note` says what is lost)."""
    if len(states) != world_size:
        return None
    return states[rank]


def dropped_note(states: Sequence[dict], world_size: int) -> str:
    """The warning for partial rollout state dropped on a resume on ``world_size`` ranks."""
    groups = sum(len(s.get("groups", ())) for s in states)
    queued = sum(len(s.get("queue", ())) for s in states)
    return (f"the checkpoint's partial rollout state is of {len(states)} ranks and this run has {world_size}: its {groups} "
            f"group(s) in flight and {queued} queued prompt(s) are dropped (those prompts are not trained in this epoch; "
            f"resume on {len(states)} ranks to keep them)")
