"""Multi-turn rollouts: continuous on an engine with incremental requests, in rounds of batch
``generate`` calls otherwise.

:class:`EnvRollout` runs ``n`` trajectories per data row: ``reset`` every environment, then
decode a turn for every trajectory that is ready, hand each turn to its environment's ``step`` on
the worker pool, and append the observation that comes back, until every trajectory is done.

Continuous (an engine with incremental requests, :func:`incremental_engine`: the native engine,
seen through its ``generate`` or through a :class:`~tidal.distributed.generate.GroupGenerator`):
a trajectory's next turn is ``add``ed as a request (its prompt: the trajectory so far; its
``max_new_tokens``: the turn's limit) the moment its observation is appended; the engine is
``step``ped while tools run; after each step the turns that finished in it are appended and
handed to the pool; the loop blocks on the pool only when the engine has nothing unfinished and
nothing is ready (``env/wait_s``: time where the engine had nothing to decode). The engine's
prefix cache serves each trajectory's earlier turns (blocks keep their hashes after a turn ends).
In a rollout TP group every rank exchanges its new requests before each step
(:meth:`~tidal.distributed.generate.GroupGenerator.exchange`, over the group's gloo twin), then
every rank adds the group's requests in rank order and steps: the ranks make identical engine
calls; the loop ends at the step where the engine has nothing unfinished and no rank has work. An
error on one rank is announced in the next exchange, every rank raises there, and the requests in
flight are aborted (the engine is left idle). ``env/generate_calls`` counts ``add`` calls.

Rounds (engines without incremental requests: HF, vLLM/SGLang adapters): the loop decodes in
*rounds*, one batch ``generate`` call per distinct token limit over the trajectories that are
ready, while the others' tools run; it blocks only when nothing is ready. In a rollout TP group
every rank joins every round (:meth:`~tidal.distributed.generate.GroupGenerator.round`), with its
ready turns or with none, so the group's engine calls stay in lockstep; the loop ends on the round
where no rank of the group has work left. A round's decode and the tool waits of the trajectories
in it do not overlap: a trajectory whose tool answered waits for the next round.

Both loops share the builders, the renderer, the pool, the limits and the error handling, and give
the same trajectories under greedy decoding.

Reproducibility: on an engine with incremental requests every token of a trajectory is drawn with
a uniform keyed by (the rollout's seed, the trajectory's request id, the token's index in it)
(:func:`~tidal.engine.sampler.keyed_uniforms`), so with sampling two runs with the same seed give
the same trajectories whatever the tools' timing and whichever turns share an engine step (given
environments that answer the same). ``env.lockstep`` only makes each round of turns wait for every
environment step (continuous loop: a trajectory's next turn is added once the engine is idle and
every step has answered); it is what makes rollouts reproducible on engines without incremental
requests (rounds: a batch ``generate`` call keys its draws by the sequence's index in the call, so
there it is the round's composition that must not depend on timing).

In flight across rollouts (``rollout.partial.mode: carry``, :class:`InFlightTrajectories`): the
same continuous loop, kept beyond one rollout: a stop rule ends a rollout at an engine step (turns
decoding then are cut and resume with their tokens next time, tools called go on running), and
when the engine would idle new trajectories start (``admit``).

Single turn: with ``env.name: single_turn`` this makes exactly one engine call on every engine
(rounds), with the same prompts (each row's ids) and the same sampling parameters (``n`` included)
as a plain rollout, so the completions are those of a plain rollout. Through a
:class:`~tidal.distributed.generate.GroupGenerator` over an engine with incremental requests that
call is the engine's requests numbered as its ``generate`` numbers them (the same keyed draws, the
same completions), stepped by :func:`~tidal.engine.stepping.run_steps`, whose ``on_finished``
hands each sequence to its trajectory the moment it finishes: the trajectory ends and is reported
to ``on_trajectory`` (the trainer scores its group then) while the rest of the batch decodes.

Limits (``env.*``): ``max_turns``; ``max_tokens_per_turn`` (each turn's ``max_new_tokens``: it, or
the sampler's when it is 0, and never more than what is left of ``max_total_tokens``); ``max_total_tokens``
(an observation that leaves no room for one more sampled token ends the trajectory). The model's
context (``max_context``: its ``max_position_embeddings``) bounds every trajectory too, whatever
``max_total_tokens`` says (its default 0 leaves only this bound): a turn samples at most what the
context has left, and an observation after which the context would have no room for one more
sampled token ends the trajectory with finish reason ``max_total_tokens`` (kept, not dropped: its
turns are trained); a first observation (``reset``) that leaves no such room is an environment
error (``env.on_error``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter, defaultdict
from typing import Any, Callable, Protocol

from tidal.distributed.generate import Exchange, GenerateBatch, OnFinished, Round, check_budgets, force_end
from tidal.engine.base import Completion, IncrementalEngine, Request, SamplingParams, sequence_key, supports_incremental
from tidal.engine.stepping import EngineRun, run_steps
from tidal.envs.base import EnvFactory, EnvRow, Environment, ModelTurn, Observation, StepResult, env_class, make_env_factory
from tidal.envs.chat import ChatRenderer
from tidal.envs.config import EnvConfig
from tidal.envs.executor import Outcome, StepPool
from tidal.envs.trajectory import FINISH_REASONS, FinishReason, Trajectory, TrajectoryBuilder, sampled_versions

# engine.generate(prompts, params[, mm_inputs=...]): mm_inputs is passed only when a row has images
Generate = Callable[..., list[Completion]]


class Generator(Protocol):
    """What the loop decodes through (:class:`~tidal.distributed.generate.GroupGenerator`): a
    ``round`` of engine calls for this rank's ready turns; ``exchange``, the requests every rank of
    the group adds before an engine step (continuous loop); and ``poll_s``, how long to wait for the
    environments when nothing is ready before joining the next round or step (None: until one answers)."""

    poll_s: float | None
    group_size: int  # ranks of the TP group
    rank: int  # this rank's index in it

    def round(self, batches: list[GenerateBatch], *, busy: bool, failure: str | None = None,
              on_finished: OnFinished | None = None) -> Round: ...

    def exchange(self, requests: list[Request], *, busy: bool, failure: str | None = None) -> Exchange: ...


class LocalGenerator:
    """A lone engine's ``generate`` as a :class:`Generator` (no group to keep in step with)."""

    poll_s = None
    group_size, rank = 1, 0

    def exchange(self, requests: list[Request], *, busy: bool, failure: str | None = None) -> Exchange:
        return Exchange(requests=list(requests), group_busy=busy)

    def __init__(self, generate: Generate):
        self.generate = generate

    def round(self, batches: list[GenerateBatch], *, busy: bool, failure: str | None = None,
              on_finished: OnFinished | None = None) -> Round:
        out = []
        for j, b in enumerate(batches):  # mm_inputs only when a prompt has images: engines without them never see it
            extra = {"mm_inputs": b.mm_inputs} if b.mm_inputs is not None else {}
            out.append(self.generate(b.prompts, b.params, **extra))
            for k, c in enumerate(out[-1] if on_finished is not None else ()):  # once the call returns
                on_finished(j, k, c)
        return Round(completions=out, group_busy=busy)


# When the loop had to wait for an environment, it also takes the answers that arrive within this
# many seconds of the previous one before it decodes (see _Run._collect_burst).
BURST_GAP_S = 0.005

# Counters the loop itself keeps: environment errors dropped (env.on_error: drop) and trajectories
# ended by a failing tool (env.tool_failure: drop).
LOOP_COUNTERS = ("errors", "tool_failure_drops")


class EnvError(RuntimeError):
    """An environment raised (or timed out) with ``env.on_error: raise``."""


@dataclasses.dataclass(kw_only=True)
class _Episode:
    env: Environment
    row: EnvRow
    group_id: int
    sample: int  # its index among its row's n trajectories: with group_id, the key of its random stream
    builder: TrajectoryBuilder | None = None
    tools: list[dict] | None = None  # tool schemas of the first observation (history: template)
    last_turn: ModelTurn | None = None
    rendered: list[dict] = dataclasses.field(default_factory=list)  # history: template, what is re-rendered
    counters: Counter = dataclasses.field(default_factory=Counter)
    result: Trajectory | None = None
    budget: int | None = None  # this sequence's own max_new_tokens (single turn; see EnvRollout.run)
    key: int = 0  # its key in the run (its position in EnvRollout.run; InFlightTrajectories: its request key)
    seed: int | None = None  # its sampling seed (None: the run's params.seed); in flight, that of the step that started it
    partial: Completion | None = None  # in flight: its turn cut at a rollout's end (tokens, logprobs, versions), resumed next


@dataclasses.dataclass(kw_only=True)
class RolloutResult:
    """``trajectories``: row-major (the n of row 0, then row 1, ...); ``metrics``: ``env/*``."""

    trajectories: list[Trajectory]
    metrics: dict[str, float]


def make_rollout(cfg: EnvConfig, tokenizer, *, max_context: int | None = None):
    """The rollout of ``env``: :class:`EnvRollout`, or the environment's own when another library
    drives its episodes (``Environment.drives_own_episodes``: verifiers)."""
    cls = env_class(cfg)
    if cls.drives_own_episodes:
        return cls.rollout(cfg, tokenizer, max_context=max_context)
    return EnvRollout(cfg, tokenizer, max_context=max_context)


class EnvRollout:
    """Drives one environment per trajectory (see module docstring).

    tokenizer: the policy's tokenizer (decoding turns; rendering chat observations).
    env_factory: a callable making one environment (default: from ``cfg``).
    max_context: the most tokens the engine may hold for one trajectory's row (the model's
        ``max_position_embeddings``; None: no bound but ``cfg``'s), see the module docstring.
    """

    def __init__(self, cfg: EnvConfig, tokenizer: Any, *, env_factory: EnvFactory | None = None, max_context: int | None = None):
        self.cfg = cfg
        self.max_context = max_context
        self.renderer = ChatRenderer(tokenizer, cfg.chat_template_kwargs)
        self.env_factory = env_factory or make_env_factory(cfg)
        probe = self.env_factory()
        if probe.uses_tools:  # the tool helpers follow the Qwen2.5/Qwen3 templates
            self.renderer.check_tool_messages()
        self.single_turn = probe.single_turn  # always one batch generate: the plain rollout's call
        _close(probe)

    def run(self, generate: Generate | Generator, rows: list[EnvRow], params: SamplingParams, *,
            first_group_id: int = 0, budgets: list[int] | None = None, end_token_id: int | None = None,
            on_trajectory: Callable[[int, Trajectory], None] | None = None) -> RolloutResult:
        """Run ``params.n`` trajectories per row; the n of row i share group id ``first_group_id + i``.
        ``generate``: an engine's ``generate`` or a :class:`Generator` (in a TP group: every rank of
        the group calls ``run`` with its own rows, and the generator keeps their calls in step).
        When it is the ``generate`` of an engine with incremental requests, or a
        :class:`~tidal.distributed.generate.GroupGenerator` over such an engine, a multi-turn
        rollout is continuous (module docstring); ``single_turn`` and budgets always use rounds.

        ``budgets`` (single turn only): one ``max_new_tokens`` per trajectory, row-major, each in
        ``1..params.max_new_tokens``; with ``end_token_id`` a sequence cut at its budget ends with
        that token instead (:func:`~tidal.distributed.generate.force_end`).

        ``on_trajectory(i, trajectory)`` is called the moment trajectory ``i`` (its position in the
        result) ends, on this thread, while the others may still decode (e.g. to score it then)."""
        if budgets is not None and self.cfg.name != "single_turn":
            raise ValueError(f"per-sequence budgets (ExperienceMaker.completion_budget) apply to single-turn rollouts; "
                             f"env.name is {self.cfg.name!r}: bound its trajectories with env.max_total_tokens instead")
        episodes = [_Episode(env=self.env_factory(), row=row, group_id=first_group_id + i, sample=j, key=i * params.n + j)
                    for i, row in enumerate(rows) for j in range(params.n)]
        if budgets is not None:
            check_budgets(budgets, len(episodes), params.max_new_tokens)
            for ep, b in zip(episodes, budgets):
                ep.budget = int(b)
        gen = generate if hasattr(generate, "round") else LocalGenerator(generate)
        engine = None if self.single_turn or budgets is not None else incremental_engine(generate)
        run = _Run(self, {ep.key: ep for ep in episodes}, gen, params, end_token_id, on_trajectory)
        try:
            run.loop() if engine is None else run.loop_continuous(engine)
        finally:
            run.pool.shutdown()
            for ep in episodes:
                _close(ep.env)
        return RolloutResult(trajectories=[ep.result for ep in episodes], metrics=run.metrics())


class InFlightTrajectories:
    """Multi-turn trajectories kept in flight across rollouts (``rollout.partial.mode: carry``;
    :class:`~tidal.trainer.partial.LongTailRollout` decides which start, which are trained and when
    a rollout ends). It owns one continuous loop's state (:meth:`_Run.loop_continuous`) beyond a
    single rollout: the trajectories, their environments and the pool running their steps. Between
    two rollouts (while the trainer trains) the tools called at the end of one keep running; a
    turn cut by a rollout's end keeps its tokens, logprobs and policy versions and goes on after
    them in the next (re-prefilled under the new weights, :class:`~tidal.engine.base.Request`).

    A trajectory is known by its key (the caller's: unique among those in flight) and draws its
    tokens with the seed it was started with and its (group, sample) stream key, so which run
    decodes a turn does not change its random numbers; which weights sample it does (each token
    keeps the version and logprob of the weights that sampled it, ``TrajectoryRow.versions``).
    Under a rollout TP group the trajectories' end (and so a rollout's end) would differ between
    ranks: not supported (checked in the config)."""

    def __init__(self, rollout: EnvRollout, params: SamplingParams):
        self.rollout = rollout
        self.run = _Run(rollout, {}, LocalGenerator(None), params)

    def start(self, key: int, row: EnvRow, group_id: int, sample: int, seed: int | None) -> None:
        """Start a trajectory of ``row`` (its environment made and reset now, on the pool)."""
        if key in self.run.episodes:
            raise ValueError(f"trajectory key {key} is in flight already")
        self.run.start(_Episode(env=self.rollout.env_factory(), row=row, group_id=group_id, sample=sample, key=key,
                                seed=seed))

    def drop(self, keys: list[int]) -> None:
        """Forget trajectories (trained, or restarted): their environments are closed; a call of
        theirs still running is ignored when it answers."""
        for key in keys:
            ep = self.run.episodes.pop(key, None)
            if ep is not None:
                self.run.resetting.discard(key)
                if key in self.run.ready:
                    self.run.ready.remove(key)
                _close(ep.env)

    def __contains__(self, key: int) -> bool:
        return key in self.run.episodes

    def result(self, key: int) -> Trajectory | None:
        """The trajectory ``key`` once it ended, else None."""
        return self.run.episodes[key].result

    def versions(self, key: int) -> list[int]:
        """The policy versions of trajectory ``key``'s sampled tokens so far (a cut turn's too)."""
        ep = self.run.episodes[key]
        done = sampled_versions(ep.builder.rows) if ep.builder is not None else []
        return done + (list(ep.partial.versions) if ep.partial is not None else [])

    def collect(self, engine: IncrementalEngine, params: SamplingParams, *, stop: Callable[[], bool],
                admit: Callable[[], None], on_trajectory: Callable[[int, Trajectory], None]) -> EngineRun:
        """One rollout on the idle ``engine`` (this rank alone): the trajectories go on (new ones
        reset first) until ``stop()``, asked before every engine step, says so. ``admit()`` is called
        when the engine would otherwise idle (nothing decoding, nothing ready); it may :meth:`start`
        trajectories. ``on_trajectory(key, trajectory)``: each trajectory that ends. ``params``: the
        rollout's sampling settings (its seed for trajectories started without one)."""
        run = self.run
        run.gen, run.params, run.timing, run.calls = LocalGenerator(None), params, Counter(), 0
        run.on_trajectory, run.admit, run.failure = on_trajectory, admit, None
        try:
            return run.loop_continuous(engine, stop=stop)
        finally:
            run.on_trajectory = run.admit = None

    def metrics(self, keys: list[int]) -> dict[str, float]:
        """The ``env/*`` metrics of trajectories ``keys`` (ended), with the last rollout's timings."""
        return self.run.metrics(keys)

    def close(self) -> None:
        """Close every environment; running calls finish in the background, ignored."""
        self.run.pool.shutdown()
        self.drop(list(self.run.episodes))


def incremental_engine(generate: Generate | Generator) -> IncrementalEngine | None:
    """The engine a rollout drives continuously through ``generate``, or None (rounds): the engine
    of a bound ``generate`` method or of a :class:`~tidal.distributed.generate.GroupGenerator`
    (any TP size), when it offers incremental requests."""
    if hasattr(generate, "round"):
        engine = getattr(generate, "engine", None)
    else:
        engine = getattr(generate, "__self__", None) if getattr(generate, "__name__", "") == "generate" else None
    return engine if engine is not None and supports_incremental(engine) else None


def _close(env: Environment) -> None:
    try:
        env.close()
    except Exception:  # a failing close must not hide the rollout's result or error
        pass


class _Run:
    """The state of one :meth:`EnvRollout.run` call."""

    def __init__(self, owner: EnvRollout, episodes: dict[int, _Episode], gen: Generator, params: SamplingParams,
                 end_token_id: int | None = None, on_trajectory: Callable[[int, Trajectory], None] | None = None):
        self.cfg, self.renderer, self.max_context = owner.cfg, owner.renderer, owner.max_context
        self.episodes, self.gen, self.params = episodes, gen, params
        self.end_token_id = end_token_id
        self.pool = StepPool(self.cfg.workers, self.cfg.step_timeout_s)
        self.ready: list[int] = []
        self.calls = 0  # engine calls that start turns: batch generate calls, or add calls (continuous)
        self.timing = Counter()
        # continuous loop: an error to announce to the group, the turns of the last engine step, when it started
        self.failure: Exception | None = None
        self.turns_done: list[Completion] = []
        self.stepped_at: float | None = None
        self.on_trajectory = on_trajectory
        self.resetting: set[int] = set()  # episodes whose reset has not answered yet
        self.admit: Callable[[], None] | None = None  # in flight: starts new episodes when the engine would idle

    # ---- the loop ------------------------------------------------------------------------------------
    def start(self, ep: _Episode) -> None:
        """Add episode ``ep`` (a free ``key``) and submit its ``reset``."""
        self.episodes[ep.key] = ep
        self.resetting.add(ep.key)
        self.pool.submit(ep.key, ep.env.reset, ep.row)

    def loop(self) -> None:
        for ep in list(self.episodes.values()):
            self.start(ep)
        with self._failing_together():
            while len(self.pool):  # every reset first, so the first turn is one batch
                self._collect(block=True)
        while True:  # one round per iteration (see the module docstring)
            with self._failing_together():
                if self.cfg.lockstep:  # the whole round's answers first: its batches do not depend on timing
                    while len(self.pool):
                        self._collect(block=True)
                elif not self.ready and len(self.pool):
                    self._collect(block=True, timeout=self.gen.poll_s)
                    if self.ready:
                        self._collect_burst()
            if not self._decode():
                return
            with self._failing_together():
                self._collect(block=False)

    @contextlib.contextmanager
    def _failing_together(self):
        """An error between rounds (an environment error with ``env.on_error: raise``) is announced
        to the group in one more round before it is raised, so the other ranks of a TP group raise
        too instead of waiting for this rank in their next round."""
        try:
            yield
        except Exception as e:
            self.gen.round([], busy=False, failure=f"{type(e).__name__}: {e}")
            raise

    def _collect_burst(self) -> None:
        """After waiting for the first answer: also take the answers that follow it closely (each
        within ``BURST_GAP_S`` of the previous). Tools started together finish together, give or
        take scheduling jitter; with a batch ``generate`` per round, decoding the first of them
        alone would make the others wait a whole turn. A tool that answers later is not waited for."""
        while len(self.pool):
            before = len(self.ready)
            self._collect(block=True, timeout=BURST_GAP_S)
            if len(self.ready) == before:
                return

    def _collect(self, *, block: bool, timeout: float | None = None) -> None:
        t0 = time.perf_counter()
        outcomes = self.pool.collect(block=block, timeout=timeout)
        if block:
            self.timing["wait_s"] += time.perf_counter() - t0
        for out in outcomes:
            self._handle(out)

    def _handle(self, out: Outcome) -> None:
        i = out.key
        ep = self.episodes.get(i)
        if ep is None:  # an episode dropped while its call ran (in flight: restarted past the staleness bound)
            return
        self.resetting.discard(i)
        stage = "reset" if ep.builder is None else f"step of turn {len(ep.builder.turns) - 1}"
        try:
            if out.error is not None:
                raise out.error
            if ep.builder is None:
                self._start(ep, out.value)
                self.ready.append(i)
            elif self._advance(ep, out.value):
                self.ready.append(i)
        except Exception as e:
            self._env_error(ep, stage, e)

    # ---- trajectories ----------------------------------------------------------------------------------
    def _start(self, ep: _Episode, obs: Observation) -> None:
        if not isinstance(obs, Observation) or obs.empty:
            raise TypeError(f"reset must return a non-empty Observation, got {obs!r:.80}")
        if obs.token_ids:
            prompt, messages = list(obs.token_ids), list(ep.row.messages or [])
        else:
            prompt, messages = self.renderer.prompt_ids(obs.messages, obs.tools), obs.messages
        if not self._fits(len(prompt)):
            raise ValueError(f"the first observation has {len(prompt)} tokens: the model's context ({self.max_context} "
                             "positions) leaves no room to sample a turn")
        ep.tools = obs.tools
        ep.rendered = [dict(m) for m in messages]
        ep.builder = TrajectoryBuilder(prompt, messages)

    def _advance(self, ep: _Episode, res: StepResult) -> bool:
        """Apply a step's result; True when the trajectory continues (ready for its next turn)."""
        if not isinstance(res, StepResult):
            raise TypeError(f"step must return a StepResult, got {res!r:.80}")
        b = ep.builder
        ep.counters.update(res.counters)
        if res.failed is not None:
            ep.counters["tool_failure_drops"] += 1
            self._finish(ep, "tool_failure", valid=False, error=res.failed)
            return False
        if res.done:
            self._finish(ep, "done", outcome_reward=res.reward)
            return False
        b.set_turn_reward(res.reward)
        if len(b.turns) >= self.cfg.max_turns:
            self._finish(ep, "max_turns")
            return False
        obs = res.observation
        if not isinstance(obs, Observation) or obs.empty or obs.tools is not None:
            raise TypeError("a step that is not done must return a non-empty Observation without tools")
        obs_ids = list(obs.token_ids) if obs.token_ids else self.renderer.observation_ids(obs.messages, ep.last_turn)
        limit = self.cfg.max_total_tokens
        if limit and b.num_response_tokens + len(obs_ids) + 1 > limit:
            self._finish(ep, "max_total_tokens")
            return False
        if self.cfg.history == "append":
            if not self._fits(len(b.context_ids) + len(obs_ids)):  # the model's context is full
                self._finish(ep, "max_total_tokens")
                return False
            b.add_observation(obs_ids, obs.messages)
        else:
            if obs.token_ids:
                raise TypeError("env.history=template re-renders the conversation: observations must be messages, not token_ids")
            # the conversation as rendered: observation contents defused like appended ones
            rendered = ep.rendered + [{"role": "assistant", "content": ep.last_turn.text}, *self._defused(obs.messages)]
            prompt = self.renderer.prompt_ids(rendered, ep.tools)
            if not self._fits(len(prompt)):
                self._finish(ep, "max_total_tokens")
                return False
            ep.rendered = rendered
            b.count_observation(len(obs_ids), obs.messages)
            b.new_row(prompt)
        return True

    def _fits(self, context_len: int) -> bool:
        """Whether a context of ``context_len`` tokens leaves room for one more sampled token."""
        return self.max_context is None or context_len + 1 <= self.max_context

    def _defused(self, messages: list[dict]) -> list[dict]:
        return [dict(m, content=self.renderer.defuse(m["content"])) if isinstance(m.get("content"), str) else dict(m)
                for m in messages]

    def _finish(self, ep: _Episode, reason: FinishReason, *, outcome_reward: float = 0.0, valid: bool = True,
                error: str | None = None) -> None:
        builder = ep.builder or TrajectoryBuilder(list(ep.row.prompt_ids) or [0], ep.row.messages)
        ep.result = builder.finish(row=ep.row, group_id=ep.group_id, finish_reason=reason, outcome_reward=outcome_reward,
                                   valid=valid, error=error, counters=dict(ep.counters))
        if self.on_trajectory is not None:
            self.on_trajectory(ep.key, ep.result)

    def _env_error(self, ep: _Episode, stage: str, exc: BaseException) -> None:
        msg = f"environment '{ep.env.name}' failed on row {ep.row.where} ({stage}): {type(exc).__name__}: {exc}"
        if self.cfg.on_error == "raise":
            raise EnvError(msg + " (set env.on_error=drop to drop such trajectories instead)") from exc
        ep.counters["errors"] += 1
        self._finish(ep, "env_error", valid=False, error=msg)

    # ---- decoding ----------------------------------------------------------------------------------------
    def _turn_limit(self, ep: _Episode) -> int:
        limit = self.cfg.max_tokens_per_turn or self.params.max_new_tokens
        if self.cfg.max_total_tokens:
            limit = min(limit, self.cfg.max_total_tokens - ep.builder.num_response_tokens)
        if self.max_context is not None:  # what the model's context has left (always >= 1: see _fits)
            limit = min(limit, self.max_context - len(ep.builder.context_ids))
        return limit

    def _decode(self) -> bool:
        """One round: a turn for every ready trajectory, one engine call per distinct token limit
        (in a TP group, merged with the other ranks' calls). False when no rank of the group has
        work left (the loop ends)."""
        by_limit: dict[int, list[int]] = defaultdict(list)
        for i in sorted(self.ready):  # episode order: the n trajectories of a row stay adjacent
            by_limit[self._turn_limit(self.episodes[i])].append(i)
        self.ready = []
        batches, members = [], []
        for limit, idx in sorted(by_limit.items()):
            contexts = [self.episodes[i].builder.context_ids for i in idx]
            reps, n = _shared_prompts(contexts, self.params.n)
            params = dataclasses.replace(self.params, n=n, max_new_tokens=limit,
                                         seed=None if self.params.seed is None else self.params.seed + self.calls)
            self.calls += 1
            mm = [self.episodes[idx[j]].row.mm_inputs for j in reps]
            budgets = [min(limit, self.episodes[i].budget or limit) for i in idx]  # prompt-major: idx runs n per prompt
            batches.append(GenerateBatch(prompts=[contexts[j] for j in reps], params=params,
                                         mm_inputs=mm if any(m is not None for m in mm) else None,
                                         max_new_tokens=budgets if budgets != [limit] * len(idx) else None,
                                         keys=[sequence_key(self.episodes[i].group_id, self.episodes[i].sample) for i in idx]))
            members.append(idx)
        t0 = time.perf_counter()
        rnd = self.gen.round(batches, busy=bool(batches) or len(self.pool) > 0,
                             on_finished=lambda j, k, c: self._turn_finished(members[j][k], c))
        self.timing["generate_s"] += time.perf_counter() - t0
        if rnd.failures:
            raise EnvError(f"another rank of the rollout TP group failed: {rnd.failures[0]}")
        for idx, completions in zip(members, rnd.completions):
            if len(completions) != len(idx):
                raise RuntimeError(f"the engine returned {len(completions)} completions for {len(idx)} trajectories")
        if self.failure is not None:  # an environment error met while the round decoded
            with self._failing_together():
                raise self.failure
        return rnd.group_busy

    def _turn_finished(self, i: int, c: Completion) -> None:
        """A round's completion for trajectory ``i``, the moment it finishes (engines with
        incremental requests: while the rest of the round decodes): its turn is taken and handed to
        the pool, and the answers in by now are taken too, so a trajectory that ends here (a single
        turn's) is reported to ``on_trajectory`` (and scored) while the others decode. An error
        in them is raised after the round (:meth:`_decode`), so every rank's round completes."""
        ep = self.episodes[i]
        if self.end_token_id is not None and ep.budget:
            c = force_end(c, ep.budget, self.end_token_id)
        self._take_turns([i], [c])
        if self.failure is None:
            try:
                self._collect(block=False)
            except Exception as e:
                self.failure = e

    def _take_turns(self, idx: list[int], completions: list[Completion]) -> None:
        """Append each completion to its trajectory exactly as sampled and hand the turn to the pool."""
        texts = self.renderer.decode_batch([list(c.token_ids) for c in completions])
        for i, c, text in zip(idx, completions, texts):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"the engine returned an unfinished turn ({c.finish_reason}) for trajectory {i}")
            ep = self.episodes[i]
            ep.partial = None
            ep.last_turn = ep.builder.add_turn(list(c.token_ids), list(c.logprobs), c.finish_reason, text,
                                                c.routed_experts, versions=c.versions)
            self.pool.submit(i, ep.env.step, ep.last_turn)

    # ---- continuous decoding (an engine with incremental requests) -----------------------------------------
    def loop_continuous(self, engine: IncrementalEngine, stop: Callable[[], bool] | None = None) -> EngineRun:
        """The loop over the engine's requests (module docstring), one
        :func:`~tidal.engine.stepping.run_steps` run: before each engine step :meth:`_feed` hands the
        turns that finished in the previous one to the pool, takes the environments' answers
        (blocking only when the group's engine has nothing unfinished and nothing is ready:
        ``env/wait_s``) and exchanges the new requests over the TP group
        (:meth:`~tidal.distributed.generate.GroupGenerator.exchange`), which the run adds. An error
        on a rank is announced in the exchange, so every rank raises at the same step; the requests
        in flight are aborted (the engine is left idle).

        ``stop()`` (trajectories in flight across rollouts, :class:`InFlightTrajectories`): asked
        before every engine step; True ends the run there. The turns that finished in the last step
        are handed to the pool (their tools run on), and the turns cut by the end keep their tokens
        (``_Episode.partial``) to resume in the next run."""
        for ep in self.episodes.values():
            if ep.builder is None and ep.result is None and ep.key not in self.resetting:
                self.start(ep)
        self._take_resets()
        size, rank = self.gen.group_size, self.gen.rank
        self.stepped_at = None

        def finished(c: Completion) -> None:  # this rank's turns (request id: episode * size + rank)
            if int(c.request_id) % size == rank:
                self.turns_done.append(c)

        run = run_steps(engine, feed=lambda: self._feed(engine, size, rank), on_finished=finished,
                        stop=None if stop is None else lambda done: stop())
        if self.stepped_at is not None:
            self.timing["generate_s"] += time.perf_counter() - self.stepped_at
            self.stepped_at = None
        mine, self.turns_done = self.turns_done, []
        self._take_turns([int(c.request_id) // size for c in mine], mine)  # their tools run on
        for c in run.unfinished:  # turns cut by the stop: resumed with their tokens in the next run
            if int(c.request_id) % size == rank:
                i = int(c.request_id) // size
                self.episodes[i].partial = c if c.token_ids else None
                self.ready.append(i)
        return run

    def _take_resets(self) -> None:
        """Wait for every pending ``reset`` (so the n samples of a prompt are added together)."""
        try:
            while self.resetting and self.failure is None:
                self._collect(block=True)
        except Exception as e:
            self.failure = e

    def _feed(self, engine: IncrementalEngine, size: int, rank: int) -> list[Request] | None:
        """Before an engine step: the requests the TP group adds now (every rank gets the same), or
        None when it adds none and no rank has environment calls pending (the run may end)."""
        if self.stepped_at is not None:
            self.timing["generate_s"] += time.perf_counter() - self.stepped_at
        mine, self.turns_done = self.turns_done, []
        self._take_turns([int(c.request_id) // size for c in mine], mine)
        decoding = engine.has_unfinished()
        if self.admit is not None and self.failure is None and not decoding and not self.ready and not self.resetting:
            self.admit()  # the engine would idle: new trajectories start (in flight across rollouts)
            self._take_resets()
        if self.failure is None:
            try:  # lockstep: with the engine idle, wait for every environment step (a round's barrier)
                idle = not decoding and (self.cfg.lockstep or not self.ready)
                self._collect(block=idle, timeout=self.gen.poll_s)
            except Exception as e:
                self.failure = e
        failure = self.failure
        hold = self.cfg.lockstep and (decoding or len(self.pool) > 0)  # lockstep: the next turns wait for the round
        mine = self._requests(size, rank) if failure is None and not hold else []
        ex = self.gen.exchange(mine, busy=len(self.pool) > 0 or bool(self.ready),
                               failure=None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if ex.failures:
            raise EnvError(f"another rank of the rollout TP group failed: {ex.failures[0]}")
        self.stepped_at = time.perf_counter()
        return ex.requests if ex.requests or ex.group_busy else None

    def _requests(self, size: int, rank: int) -> list[Request]:
        """The next turn of every ready trajectory, one request each (episode order, so the n
        samples of a row are adjacent and share their prompt's prefill); ``max_new_tokens`` is the
        turn's limit; the id ``episode * size + rank`` is unique over the TP group (one turn per
        trajectory is in flight at a time); the stream key is the trajectory's (its group and sample
        index, :func:`~tidal.engine.base.sequence_key`) for all its turns, as is the seed (the
        rollout's): the engine draws the token at index ``i`` of the trajectory's context with the
        keyed uniform of (seed, key, i) (:func:`~tidal.engine.sampler.keyed_uniforms`), so its
        tokens do not depend on which turns share its steps, nor so on the tools' timing."""
        if not self.ready:
            return []
        ready, self.ready = sorted(self.ready), []
        self.calls += 1
        out = []
        for i in ready:
            ep = self.episodes[i]
            params = dataclasses.replace(self.params, n=1, max_new_tokens=self._turn_limit(ep),
                                         seed=self.params.seed if ep.seed is None else ep.seed)
            cut = ep.partial  # a turn cut at the end of the previous run goes on after its tokens
            out.append(Request(request_id=i * size + rank, prompt_ids=ep.builder.context_ids, params=params,
                               group_id=ep.group_id, mm_inputs=ep.row.mm_inputs, key=sequence_key(ep.group_id, ep.sample),
                               token_ids=list(cut.token_ids) if cut else [], logprobs=list(cut.logprobs) if cut else [],
                               versions=list(cut.versions) if cut else []))
        return out

    # ---- metrics -----------------------------------------------------------------------------------------
    def metrics(self, keys: list[int] | None = None) -> dict[str, float]:
        """``env/*`` metrics of this rollout (of the episodes ``keys``, default all); every key is
        present whatever happened (a fixed set per environment: ranks reduce them by name)."""
        episodes = list(self.episodes.values()) if keys is None else [self.episodes[k] for k in keys]
        done = [ep.result for ep in episodes if ep.result is not None]
        n = max(len(done), 1)
        turns = [t for traj in done for t in traj.turns]
        out = {
            "env/turns_mean": sum(len(t.turns) for t in done) / n,
            "env/sampled_tokens_mean": sum(t.num_sampled_tokens for t in done) / n,
            "env/response_tokens_mean": sum(t.num_response_tokens for t in done) / n,
            "env/invalid_frac": sum(not t.valid for t in done) / n,
            "env/truncated_turns_frac": sum(t.finish_reason == "length" for t in turns) / max(len(turns), 1),
            "env/generate_calls": float(self.calls),
            "env/generate_s": self.timing["generate_s"],
            "env/wait_s": self.timing["wait_s"],
        }
        reasons = Counter(t.finish_reason for t in done)
        out.update({f"env/finish/{reason}_frac": reasons[reason] / n for reason in FINISH_REASONS})
        declared = {k for ep in episodes for k in ep.env.counter_names} | set(LOOP_COUNTERS)
        for key in sorted(declared | {k for t in done for k in t.counters}):
            values = [t.counters.get(key, 0.0) for t in done]
            out[f"env/{key}"] = sum(values) / n
            out[f"env/{key}_frac"] = sum(v > 0 for v in values) / n
        return out


def _shared_prompts(contexts: list[list[int]], n: int) -> tuple[list[int], int]:
    """(representatives, k): when the contexts are runs of ``n`` identical ones (the n samples of
    each row at their first turn), the index of each run's first context and k = n, so the engine
    shares each prompt's prefill exactly as a plain rollout asks for it; else every index, k = 1."""
    if n > 1 and len(contexts) % n == 0:
        starts = range(0, len(contexts), n)
        if all(contexts[j] == contexts[s] for s in starts for j in range(s + 1, s + n)):
            return list(starts), n
    return list(range(len(contexts))), 1
