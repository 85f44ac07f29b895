"""Multi-turn rollouts over the engine's batch ``generate`` (works with every engine today).

:class:`EnvRollout` runs ``n`` trajectories per data row: ``reset`` every environment, then
repeatedly decode one turn for every trajectory that is ready, hand each turn to its
environment's ``step`` on the worker pool, and append the observation that comes back. Decoding
does not wait for every tool: whatever trajectories are ready are decoded while the others' tools
run, and it blocks only when nothing is ready (``env/wait_s``). With the engine's incremental API
(add/step/drain) the same loop admits a trajectory the moment its observation is appended, instead
of at the next ``generate`` call (docs/agentic.md, "Engine integration").

Single turn: with ``env.name: single_turn`` this makes exactly one ``generate(prompts, params)``
call, with the same prompts (each row's ids) and the same sampling parameters (``n`` included) as
a plain rollout, so the completions are those of a plain rollout.

Limits (``env.*``): ``max_turns``; ``max_tokens_per_turn`` (each turn's ``max_new_tokens``: it, or
the sampler's when it is 0, and never more than what is left of ``max_total_tokens``); ``max_total_tokens``
(an observation that leaves no room for one more sampled token ends the trajectory).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from typing import Any, Callable

from tidal.engine.base import Completion, SamplingParams
from tidal.envs.base import EnvFactory, EnvRow, Environment, ModelTurn, Observation, StepResult, make_env_factory
from tidal.envs.chat import ChatRenderer
from tidal.envs.config import EnvConfig
from tidal.envs.executor import Outcome, StepPool
from tidal.envs.tool_env import ToolEnv
from tidal.envs.trajectory import FinishReason, Trajectory, TrajectoryBuilder

# engine.generate(prompts, params[, mm_inputs=...]): mm_inputs is passed only when a row has images
Generate = Callable[..., list[Completion]]


class EnvError(RuntimeError):
    """An environment raised (or timed out) with ``env.on_error: raise``."""


@dataclasses.dataclass(kw_only=True)
class _Episode:
    env: Environment
    row: EnvRow
    group_id: int
    builder: TrajectoryBuilder | None = None
    tools: list[dict] | None = None  # tool schemas of the first observation (history: template)
    last_turn: ModelTurn | None = None
    rendered: list[dict] = dataclasses.field(default_factory=list)  # history: template, what is re-rendered
    counters: Counter = dataclasses.field(default_factory=Counter)
    result: Trajectory | None = None


@dataclasses.dataclass(kw_only=True)
class RolloutResult:
    """``trajectories``: row-major (the n of row 0, then row 1, ...); ``metrics``: ``env/*``."""

    trajectories: list[Trajectory]
    metrics: dict[str, float]


class EnvRollout:
    """Drives one environment per trajectory (see module docstring).

    tokenizer: the policy's tokenizer (decoding turns; rendering chat observations).
    env_factory: a callable making one environment (default: from ``cfg``).
    """

    def __init__(self, cfg: EnvConfig, tokenizer: Any, *, env_factory: EnvFactory | None = None):
        self.cfg = cfg
        self.renderer = ChatRenderer(tokenizer, cfg.chat_template_kwargs)
        self.env_factory = env_factory or make_env_factory(cfg)
        probe = self.env_factory()
        if isinstance(probe, ToolEnv):  # the tool helpers follow the Qwen2.5/Qwen3 templates
            self.renderer.check_tool_messages()
        _close(probe)

    def run(self, generate: Generate, rows: list[EnvRow], params: SamplingParams, *, first_group_id: int = 0) -> RolloutResult:
        """Run ``params.n`` trajectories per row; the n of row i share group id ``first_group_id + i``."""
        episodes = [_Episode(env=self.env_factory(), row=row, group_id=first_group_id + i)
                    for i, row in enumerate(rows) for _ in range(params.n)]
        run = _Run(self, episodes, generate, params)
        try:
            run.loop()
        finally:
            run.pool.shutdown()
            for ep in episodes:
                _close(ep.env)
        return RolloutResult(trajectories=[ep.result for ep in episodes], metrics=run.metrics())


def _close(env: Environment) -> None:
    try:
        env.close()
    except Exception:  # a failing close must not hide the rollout's result or error
        pass


class _Run:
    """The state of one :meth:`EnvRollout.run` call."""

    def __init__(self, owner: EnvRollout, episodes: list[_Episode], generate: Generate, params: SamplingParams):
        self.cfg, self.renderer = owner.cfg, owner.renderer
        self.episodes, self.generate, self.params = episodes, generate, params
        self.pool = StepPool(self.cfg.workers, self.cfg.step_timeout_s)
        self.ready: list[int] = []
        self.calls = 0
        self.timing = Counter()

    # ---- the loop ------------------------------------------------------------------------------------
    def loop(self) -> None:
        for i, ep in enumerate(self.episodes):
            self.pool.submit(i, ep.env.reset, ep.row)
        while len(self.pool):  # every reset first, so the first turn is one batch
            self._collect(block=True)
        while self.ready or len(self.pool):
            if self.ready:
                self._decode()
                self._collect(block=False)
            else:
                self._collect(block=True)

    def _collect(self, *, block: bool) -> None:
        t0 = time.perf_counter()
        outcomes = self.pool.collect(block=block)
        if block:
            self.timing["wait_s"] += time.perf_counter() - t0
        for out in outcomes:
            self._handle(out)

    def _handle(self, out: Outcome) -> None:
        i = out.key
        ep = self.episodes[i]
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
            b.add_observation(obs_ids, obs.messages)
        else:
            if obs.token_ids:
                raise TypeError("env.history=template re-renders the conversation: observations must be messages, not token_ids")
            b.count_observation(len(obs_ids), obs.messages)
            # the conversation as rendered: observation contents defused like appended ones
            ep.rendered += [{"role": "assistant", "content": ep.last_turn.text}, *self._defused(obs.messages)]
            b.new_row(self.renderer.prompt_ids(ep.rendered, ep.tools))
        return True

    def _defused(self, messages: list[dict]) -> list[dict]:
        return [dict(m, content=self.renderer.defuse(m["content"])) if isinstance(m.get("content"), str) else dict(m)
                for m in messages]

    def _finish(self, ep: _Episode, reason: FinishReason, *, outcome_reward: float = 0.0, valid: bool = True,
                error: str | None = None) -> None:
        builder = ep.builder or TrajectoryBuilder(list(ep.row.prompt_ids) or [0], ep.row.messages)
        ep.result = builder.finish(row=ep.row, group_id=ep.group_id, finish_reason=reason, outcome_reward=outcome_reward,
                                   valid=valid, error=error, counters=dict(ep.counters))

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
        return limit

    def _decode(self) -> None:
        """One turn for every ready trajectory: one generate call per distinct token limit."""
        by_limit: dict[int, list[int]] = defaultdict(list)
        for i in sorted(self.ready):  # episode order: the n trajectories of a row stay adjacent
            by_limit[self._turn_limit(self.episodes[i])].append(i)
        self.ready = []
        for limit, idx in sorted(by_limit.items()):
            contexts = [self.episodes[i].builder.context_ids for i in idx]
            reps, n = _shared_prompts(contexts)
            params = dataclasses.replace(self.params, n=n, max_new_tokens=limit,
                                         seed=None if self.params.seed is None else self.params.seed + self.calls)
            self.calls += 1
            mm = [self.episodes[idx[j]].row.mm_inputs for j in reps]
            extra = {"mm_inputs": mm} if any(m is not None for m in mm) else {}  # only engines with images take it
            t0 = time.perf_counter()
            completions = self.generate([contexts[j] for j in reps], params, **extra)
            self.timing["generate_s"] += time.perf_counter() - t0
            if len(completions) != len(idx):
                raise RuntimeError(f"the engine returned {len(completions)} completions for {len(idx)} trajectories")
            for i, c in zip(idx, completions):
                ep = self.episodes[i]
                ep.last_turn = ep.builder.add_turn(list(c.token_ids), list(c.logprobs), c.finish_reason,
                                                   self.renderer.decode(list(c.token_ids)))
                self.pool.submit(i, ep.env.step, ep.last_turn)

    # ---- metrics -----------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        done = [ep.result for ep in self.episodes if ep.result is not None]
        n = max(len(done), 1)
        out = {
            "env/turns_mean": sum(len(t.turns) for t in done) / n,
            "env/sampled_tokens_mean": sum(t.num_sampled_tokens for t in done) / n,
            "env/response_tokens_mean": sum(t.num_response_tokens for t in done) / n,
            "env/invalid_frac": sum(not t.valid for t in done) / n,
            "env/generate_calls": float(self.calls),
            "env/generate_s": self.timing["generate_s"],
            "env/wait_s": self.timing["wait_s"],
        }
        for reason, count in Counter(t.finish_reason for t in done).items():
            out[f"env/finish/{reason}_frac"] = count / n
        totals: Counter = Counter()
        for t in done:
            totals.update(t.counters)
        out.update({f"env/{k}": float(v) for k, v in totals.items()})
        return out


def _shared_prompts(contexts: list[list[int]]) -> tuple[list[int], int]:
    """(representatives, n): when the contexts are runs of k identical ones (the n samples of each
    row at their first turn), the index of each run's first context and n = k, so the engine
    shares each prompt's prefill; else every index with n = 1."""
    for k in range(len(contexts), 1, -1):
        if len(contexts) % k:
            continue
        starts = range(0, len(contexts), k)
        if all(contexts[j] == contexts[s] for s in starts for j in range(s + 1, s + k)):
            return list(starts), k
    return list(range(len(contexts))), 1
