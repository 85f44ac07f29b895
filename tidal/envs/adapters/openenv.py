"""OpenEnv environments in process (``env.name: openenv``; the extra ``openenv``: ``pip install -e '.[openenv]'``).

``env.kwargs.environment`` names an OpenEnv ``Environment`` subclass (``module:Class``); each
trajectory gets its own instance (``environment_kwargs`` to its constructor), run in this process
(not through OpenEnv's per-request HTTP endpoints, which start a fresh environment per call).
Turns map to OpenEnv calls:

- ``reset``: ``env.reset(seed=row.metadata[seed_key])`` (no seed when the row has none); the first
  observation is the row's messages followed by the observation's text as a ``user`` message.
- each model turn: ``env.step(Action(**{action_field: turn text}))``; the observation's text comes
  back as a ``role`` message (``user`` by default), rendered by the chat template and appended;
  its ``reward`` is the turn's reward (the outcome reward when ``done``).

The observation's text is its ``observation_field`` (default: its only string field besides
``done``/``reward``/``metadata``; with several, those fields as JSON). The Action class is the
environment's generic parameter (``Environment[MyAction, MyObservation, MyState]``) unless
``action`` names one. ``openenv`` is imported only when the environment is built.
"""

from __future__ import annotations

import json
import typing
from typing import Any

from tidal.config_base import ConfigError, check
from tidal.envs.adapters import import_object
from tidal.envs.base import EnvRow, Environment, ModelTurn, Observation, StepResult
from tidal.envs.config import EnvConfig

_BASE_FIELDS = ("done", "reward", "metadata")


def action_class(env_cls: type, named: str | None) -> type:
    """The Action class: ``named`` (``module:Class``) or the first generic argument of the
    environment's OpenEnv base class."""
    if named:
        return import_object(named, "env.kwargs.action")
    for base in getattr(env_cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type):
            return args[0]
    raise ConfigError("env.kwargs.action", f"{env_cls.__name__} does not say its Action class (Environment[Action, ...]): "
                                           "name it as env.kwargs.action: module:Class")


def observation_class(env_cls: type) -> type | None:
    """The Observation class of the environment: its OpenEnv base class's (``Environment[Action,
    Observation, State]``), else ``reset``'s return annotation; None when neither says."""
    for base in getattr(env_cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if len(args) > 1 and isinstance(args[1], type):
            return args[1]
    try:
        returned = typing.get_type_hints(env_cls.reset).get("return")
    except Exception:  # noqa: BLE001 -- an annotation that does not resolve says nothing
        return None
    return returned if isinstance(returned, type) else None


def check_observation_field(env_cls: type, field: str | None) -> None:
    """ConfigError at ``env.kwargs.observation_field`` when the environment's Observation class
    (when it says one) has no such field: found before the first step (``tidal check``)."""
    obs_cls = observation_class(env_cls)
    if field is None or obs_cls is None or not hasattr(obs_cls, "model_fields"):
        return
    fields = sorted(f for f in obs_cls.model_fields if f not in _BASE_FIELDS)
    if field not in obs_cls.model_fields:
        raise ConfigError("env.kwargs.observation_field", f"{obs_cls.__name__} has no field {field!r}; its fields: {fields}")


def construct(env_cls: type, kwargs: dict | None) -> Any:
    """``env_cls(**kwargs)``; a constructor that refuses them is a one-line ConfigError at
    ``env.kwargs.environment_kwargs`` (its error's first line)."""
    check(kwargs is None or isinstance(kwargs, dict), "env.kwargs.environment_kwargs", f"must be a mapping, got {kwargs!r}")
    try:
        return env_cls(**(kwargs or {}))
    except Exception as e:  # noqa: BLE001 -- whatever the user's constructor raises on its arguments
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError("env.kwargs.environment_kwargs", f"{env_cls.__name__}(**{kwargs or {}}) failed: "
                                                           f"{type(e).__name__}: {first}") from None


def observation_text(obs: Any, field: str | None) -> str:
    """The model's view of an OpenEnv observation (module docstring)."""
    data = obs.model_dump()
    if field is not None:
        if field not in data:
            raise ConfigError("env.kwargs.observation_field", f"{type(obs).__name__} has no field {field!r}; it has {sorted(data)}")
        value = data[field]
        return value if isinstance(value, str) else json.dumps(value)
    rest = {k: v for k, v in data.items() if k not in _BASE_FIELDS}
    strings = [v for v in rest.values() if isinstance(v, str)]
    return strings[0] if len(rest) == 1 and strings else json.dumps(rest)


class OpenEnvEnv(Environment):
    """An OpenEnv environment, one instance per trajectory (module docstring). Settings
    (``env.kwargs``): ``environment`` (``module:Class``), ``environment_kwargs``, ``action``,
    ``action_field`` (default: the Action's only field besides ``metadata``),
    ``observation_field``, ``role`` (``user`` or ``tool``), ``seed_key`` (default ``seed``)."""

    name = "openenv"

    def __init__(self, cfg: EnvConfig, *, environment: str = "", environment_kwargs: dict | None = None, action: str | None = None,
                 action_field: str | None = None, observation_field: str | None = None, role: str = "user",
                 seed_key: str = "seed", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        check(bool(environment), "env.kwargs.environment", "must name an OpenEnv Environment class as module:Class")
        check(role in ("user", "tool"), "env.kwargs.role", f"must be user or tool, got {role!r}")
        from openenv.core.env_server.interfaces import Environment as OpenEnvBase

        env_cls = import_object(environment, "env.kwargs.environment")
        check(isinstance(env_cls, type) and issubclass(env_cls, OpenEnvBase), "env.kwargs.environment",
              f"{environment!r} is not an openenv Environment subclass")
        self.action_cls = action_class(env_cls, action)
        fields = [f for f in self.action_cls.model_fields if f != "metadata"]
        self.action_field = action_field or (fields[0] if len(fields) == 1 else "")
        check(self.action_field in fields, "env.kwargs.action_field",
              f"must name the field of {self.action_cls.__name__} that takes the model's text, one of {fields}")
        check_observation_field(env_cls, observation_field)
        self.env = construct(env_cls, environment_kwargs)
        self.observation_field, self.role, self.seed_key = observation_field, role, seed_key

    def reset(self, row: EnvRow) -> Observation:
        seed = row.metadata.get(self.seed_key)
        obs = self.env.reset(seed=seed) if seed is not None else self.env.reset()
        text = observation_text(obs, self.observation_field)
        messages = [dict(m) for m in row.messages or []] + ([{"role": "user", "content": text}] if text else [])
        if not messages:
            raise ValueError(f"row {row.where} has no chat messages and the environment's first observation is empty")
        return Observation(messages=messages)

    def step(self, turn: ModelTurn) -> StepResult:
        obs = self.env.step(self.action_cls(**{self.action_field: turn.text}))
        reward = float(obs.reward or 0.0)
        if obs.done:
            return StepResult(done=True, reward=reward)
        message = {"role": self.role, "content": observation_text(obs, self.observation_field)}
        return StepResult(observation=Observation(messages=[message]), reward=reward)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()
