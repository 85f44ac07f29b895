"""verifiers v1 environments (``env.name: verifiers``; the extra ``verifiers``: ``pip install -e '.[verifiers]'``).

A verifiers environment drives its own episodes (its harness program talks to a model endpoint,
its task scores the trace), so it is not stepped turn by turn like a Tidal
:class:`~tidal.envs.base.Environment`: :class:`VerifiersRollout` takes the rollout's place.

- **The model it calls is Tidal's engine.** verifiers' training client (``TrainClient``: the chat
  template rendered by ``renderers``, then vLLM's ``POST /inference/v1/generate``) is pointed at
  :class:`~tidal.engine.generate_endpoint.GenerateEndpoint`, which the rollout serves on its own
  thread with the engine's ``generate`` while the verifiers episodes run on an event loop of
  their own thread. The sampling filter is the run's (``rollout.temperature``, ``top_p``);
  ``max_tokens`` is ``rollout.max_new_tokens``.
- **Rows are tasks.** Each data row becomes a task of the taskset's task type: its chat messages
  as the task's ``prompt``, and every row field (``reference`` included) that the task's data
  class declares; ``rollout.n_samples`` episodes per row, grouped as usual.
- **Traces become trajectories, checked token for token.** Each trainable branch of an episode's
  trace (verifiers' training sample: ``token_ids``, ``sampled_mask``, ``logprobs``) becomes a row
  of the trajectory: the tokens before the first sampled one are the prompt, each run of sampled
  tokens a turn, the tokens between them an observation. Every sampled run must be a completion
  the endpoint served (the same prompt, ids and logprobs), else the rollout stops with an error:
  what is trained is what the engine sampled.
- **Reward.** The trace's reward (the sum of its task's ``@reward`` functions) is the
  trajectory's outcome reward, added to the run's reward components as an environment's is.
  An episode that failed (``Episode.ok`` false) follows ``env.on_error``.

Settings (``env.kwargs``): ``taskset`` (the verifiers taskset id: a module exporting its
``Taskset`` and, optionally, its default ``Harness``), ``env`` (more of verifiers' ``EnvConfig``,
e.g. ``{agent: {harness: {...}}}``; the agent's runtime defaults to ``subprocess``, on this host),
``renderer`` (a ``renderers`` config, default ``{name: default}``: the tokenizer's own chat
template), ``model`` (the name requests give, default ``tidal``). ``verifiers`` is imported only
when the environment is built; this module imports neither it nor torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from tidal.config_base import ConfigError, check
from tidal.envs.base import EnvRow, Environment
from tidal.envs.config import EnvConfig
from tidal.envs.trajectory import Trajectory, TrajectoryBuilder

if TYPE_CHECKING:
    from tidal.engine.base import SamplingParams


@dataclasses.dataclass(kw_only=True)
class VerifiersSettings:
    """``env.kwargs`` of ``env.name: verifiers`` (module docstring)."""

    taskset: str = ""
    env: dict[str, Any] = dataclasses.field(default_factory=dict)
    renderer: dict[str, Any] = dataclasses.field(default_factory=lambda: {"name": "default"})
    model: str = "tidal"

    def __post_init__(self):
        check(bool(self.taskset), "taskset", "must name a verifiers taskset (its module)")


class VerifiersEnv(Environment):
    """The name ``env.name: verifiers`` resolves to. Its episodes are run by verifiers itself
    (:class:`VerifiersRollout`), never stepped here; constructing it checks the settings and loads
    the verifiers environment once (a bad taskset id is a one-line config error)."""

    name = "verifiers"
    drives_own_episodes = True

    def __init__(self, cfg: EnvConfig, **kwargs: Any):
        super().__init__(cfg)
        from tidal.config_base import build

        self.settings = build(VerifiersSettings, kwargs, prefix="env.kwargs")
        client_config(self.settings, "http://127.0.0.1:1/v1", "")
        load_env(self.settings)

    @classmethod
    def rollout(cls, cfg: EnvConfig, tokenizer: Any, *, max_context: int | None = None) -> "VerifiersRollout":
        return VerifiersRollout(cfg, tokenizer, max_context=max_context)

    def reset(self, row: EnvRow):
        raise TypeError("a verifiers environment runs its own episodes: tidal.envs.adapters.verifiers.VerifiersRollout")

    def step(self, turn):
        raise TypeError("a verifiers environment runs its own episodes: tidal.envs.adapters.verifiers.VerifiersRollout")


def load_env(settings: VerifiersSettings):
    """verifiers' environment of ``settings`` (ConfigError at ``env.kwargs.taskset`` / ``env.kwargs.env``)."""
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    data = {"agent": {"runtime": {"type": "subprocess"}}, **settings.env, "taskset": {"id": settings.taskset}}
    try:
        return load_environment(resolve_env_config(data))
    except (ImportError, TypeError, AttributeError) as e:
        raise ConfigError("env.kwargs.taskset", f"verifiers cannot load taskset {settings.taskset!r}: {type(e).__name__}: "
                                                f"{str(e).splitlines()[0] if str(e) else ''}") from None
    except ValueError as e:  # pydantic's ValidationError of a setting
        raise ConfigError("env.kwargs.env", f"verifiers refuses the environment settings: {str(e).splitlines()[0]}") from None


def client_config(settings: VerifiersSettings, base_url: str, tokenizer_dir: str):
    """verifiers' training-client config for ``base_url`` (ConfigError at ``env.kwargs.renderer``)."""
    import verifiers.v1 as vf

    try:
        return vf.TrainClientConfig(base_url=base_url, api_key_var="TIDAL_VERIFIERS_NO_KEY", renderer=settings.renderer,
                                    renderer_model_name=tokenizer_dir or None)
    except ValueError as e:
        raise ConfigError("env.kwargs.renderer", f"not a renderers config: {' '.join(str(e).split())[:300]}") from None


def engine_generate(generate):
    """The engine's ``generate`` behind what the trainer hands a rollout (a generator of one rank,
    or ``generate`` itself); a rollout TP group of several ranks is refused."""
    if hasattr(generate, "round"):
        if generate.group_size > 1:
            raise ConfigError("engine.tp_size", "env.name=verifiers runs its episodes on one rank's engine: set engine.tp_size=1")
        return generate.engine.generate if hasattr(generate, "engine") else generate.generate
    return generate


class VerifiersRollout:
    """The rollout of ``env.name: verifiers`` (module docstring); the same ``run`` as
    :class:`~tidal.envs.rollout.EnvRollout`."""

    def __init__(self, cfg: EnvConfig, tokenizer: Any, *, max_context: int | None = None):
        import tempfile

        from tidal.config_base import build
        from tidal.engine.generate_endpoint import GenerateEndpoint

        self.cfg, self.tokenizer = cfg, tokenizer
        self.settings = build(VerifiersSettings, cfg.kwargs, prefix="env.kwargs")
        self.env = load_env(self.settings)
        # the renderer loads the run's tokenizer by path: this very tokenizer, saved once
        self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="tidal-verifiers-tokenizer-")
        tokenizer.save_pretrained(self._tokenizer_dir.name)
        self.endpoint = GenerateEndpoint(model=self.settings.model, max_model_len=max_context or 2**31 - 1)

    def run(self, generate, rows: list[EnvRow], params: SamplingParams, *, first_group_id: int = 0, budgets=None,
            end_token_id=None, on_trajectory=None):
        """``params.n`` verifiers episodes per row as a :class:`~tidal.envs.rollout.RolloutResult`."""
        from tidal.envs.rollout import RolloutResult

        if budgets is not None:
            raise ValueError("per-sequence budgets apply to single-turn rollouts, not env.name=verifiers")
        engine = engine_generate(generate)
        start = len(self.endpoint.served)
        out: dict[str, Any] = {}
        thread = threading.Thread(target=self._episodes, args=(rows, params, out), name="tidal-verifiers", daemon=True)
        thread.start()
        self.endpoint.serve(engine, params, until=lambda: not thread.is_alive())
        thread.join()
        if "error" in out:
            raise out["error"]
        served: dict[tuple, list] = {}  # (prompt, ids) -> the completions served with them (samples may coincide)
        for c in self.endpoint.served[start:]:
            served.setdefault((tuple(c.prompt_ids), tuple(c.token_ids)), []).append(c)
        del self.endpoint.served[start:]
        trajectories = []
        for k, episode in enumerate(out["episodes"]):
            i = k // params.n
            trajectories.append(self._trajectory(episode, rows[i], first_group_id + i, served))
            if on_trajectory is not None:
                on_trajectory(k, trajectories[-1])
        n = max(len(trajectories), 1)
        metrics = {"env/turns_mean": sum(len(t.turns) for t in trajectories) / n,
                   "env/errors": float(sum(not t.valid for t in trajectories)),
                   "env/verifiers_reward_mean": sum(t.outcome_reward for t in trajectories) / n}
        return RolloutResult(trajectories=trajectories, metrics=metrics)

    def _episodes(self, rows: list[EnvRow], params: SamplingParams, out: dict) -> None:
        """Run ``params.n`` verifiers episodes per row on an event loop of this thread."""
        import verifiers.v1 as vf
        from verifiers.v1.env import RunSlot

        async def main():
            client = client_config(self.settings, f"{self.endpoint.url}/v1", self._tokenizer_dir.name)
            sampling = vf.SamplingConfig(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens)
            ctx = vf.ModelContext(model=self.settings.model, client=client, sampling=sampling)
            tasks = [self._task(row) for row in rows]
            async with self.env.serving():
                return await asyncio.gather(*[self.env.run_slot(RunSlot(t), ctx) for t in tasks for _ in range(params.n)])

        try:
            out["episodes"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 -- raised on the trainer's thread
            out["error"] = e

    def _task(self, row: EnvRow):
        """The taskset's task of ``row`` (module docstring)."""
        task_cls = type(self.env.taskset).task_type()
        data_cls = task_cls.data_type()
        fields = {**row.metadata, "reference": row.reference}
        data = {k: v for k, v in fields.items() if k in data_cls.model_fields and k not in ("prompt", "idx")}
        prompt = [dict(m) for m in row.messages] if row.messages else row.prompt_text
        try:
            return task_cls(data_cls(prompt=prompt, **data), self.env.taskset.config.task)
        except ValueError as e:
            raise ValueError(f"row {row.where}: not a task of {task_cls.__name__}: {e}") from None

    def _trajectory(self, episode, row: EnvRow, group_id: int, served: dict) -> Trajectory:
        """The trajectory of one episode (module docstring); an episode that failed is invalid
        (``env.on_error: drop``) or stops the run (``raise``)."""
        branches = [b for trace in episode.traces for b in trace.branches if b.trainable] if episode.ok else []
        if not branches:
            why = "; ".join(f"{e.type}: {e.message.splitlines()[0] if e.message else ''}" for e in episode.errors) or "no trainable branch"
            if self.cfg.on_error == "raise":
                raise RuntimeError(f"verifiers episode of row {row.where} failed: {why} (env.on_error=drop leaves such episodes out)")
            builder = TrajectoryBuilder(list(row.prompt_ids))
            return builder.finish(row=row, group_id=group_id, finish_reason="env_error", valid=False, error=why)
        builder = None
        for branch in branches:
            ids, mask, logp = branch.token_ids, [int(m) for m in branch.sampled_mask], branch.logprobs
            first = mask.index(1) if 1 in mask else len(mask)
            if builder is None:
                builder = TrajectoryBuilder(ids[:first])
            else:
                builder.new_row(ids[:first])
            pos = first
            while pos < len(ids):
                end = pos
                while end < len(ids) and mask[end]:
                    end += 1
                completion = _take_served(served, ids[:pos], ids[pos:end], logp[pos:end])
                if completion is None:
                    raise RuntimeError(f"verifiers trace of row {row.where}: tokens {pos}:{end} are not what the engine sampled "
                                       "after exactly this context (ids or logprobs differ)")
                text = self.tokenizer.decode(ids[pos:end], skip_special_tokens=True)
                builder.add_turn(ids[pos:end], logp[pos:end], "length" if completion.finish_reason == "length" else "stop", text)
                nxt = end
                while nxt < len(ids) and not mask[nxt]:
                    nxt += 1
                if nxt > end:
                    builder.add_observation(ids[end:nxt], [])
                pos = nxt
        trace = episode.traces[-1]
        trajectory = builder.finish(row=row, group_id=group_id, finish_reason="done", outcome_reward=float(trace.reward))
        trajectory.messages = [{"role": m.role, "content": _text(m.content)} for m in branches[-1].messages]
        return trajectory

    def close(self) -> None:
        self.endpoint.close()
        self._tokenizer_dir.cleanup()


def _take_served(served: dict[tuple, list], prompt: list[int], ids: list[int], logprobs: list[float]):
    """The served completion of ``prompt`` with exactly ``ids`` and ``logprobs``, taken out (each
    is trained once); None when the engine sampled no such completion."""
    for k, c in enumerate(served.get((tuple(prompt), tuple(ids)), [])):
        if [float(x) for x in c.logprobs] == logprobs:
            return served[(tuple(prompt), tuple(ids))].pop(k)
    return None


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(getattr(part, "text", "") or "" for part in content)
