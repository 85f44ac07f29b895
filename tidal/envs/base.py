"""The environment contract: ``reset(row) -> first observation``, ``step(turn) -> (observation,
reward, done)``.

An :class:`Environment` instance lives for ONE trajectory (the rollout makes a fresh one per
trajectory from :func:`make_env_factory`), so it may keep the episode's state on ``self``. It
never sees token ids it must re-encode: the model's turn arrives as the sampled ids and their
decoded text, and the observation it returns is new chat messages (or token ids), which the
rollout renders with the chat template and APPENDS to the trajectory (:mod:`tidal.envs.chat`,
:mod:`tidal.envs.trajectory`).

``reset`` and ``step`` run on a worker thread of the rollout's pool (:mod:`tidal.envs.executor`)
with the limit ``env.step_timeout_s``; they may block on tools. An exception (or the limit) is an
environment error handled per ``env.on_error``.

Rewards: the reward returned with ``done=True`` is the trajectory's outcome reward (added to the
RewardEngine's score of the conversation; group estimators normalise it); a reward returned with
``done=False`` is a per-turn reward, placed at the last sampled token of that turn.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Literal

from tidal.config_base import ConfigError
from tidal.envs.config import EnvConfig, check_step_timeout

Message = dict[str, Any]


@dataclasses.dataclass(kw_only=True)
class EnvRow:
    """One data row as the environment sees it.

    prompt_ids: the dataset's prompt ids (chat template and generation prompt applied).
    prompt_text: the text those ids decode from.
    messages: the row's chat messages before rendering (None for a raw-text prompt).
    reference / label / metadata: the row's reference answer, recipe label and other fields.
    where: the row's location (``file:row``) for error messages.
    mm_inputs: the pixel inputs of the prompt's images (``prompt_ids`` hold their tokens), or None;
        passed to the engine with every turn of the row's trajectories.
    """

    prompt_ids: list[int]
    prompt_text: str
    messages: list[Message] | None = None
    reference: Any = None
    label: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    where: str = "?"
    mm_inputs: dict | None = None

    @classmethod
    def from_prompt_item(cls, item: Any) -> "EnvRow":
        """The row of a :class:`tidal.data.dataset.PromptItem` (the trainer's prompt type)."""
        return cls(prompt_ids=list(item.prompt_ids), prompt_text=item.prompt_text, messages=item.messages,
                   reference=item.reference, label=item.label, metadata=dict(item.metadata), where=f"{item.source}:{item.row}",
                   mm_inputs=item.mm_inputs)


@dataclasses.dataclass(kw_only=True)
class Observation:
    """What the model sees next.

    messages: new chat messages (``{"role": "tool" | "user" | ..., "content": str}``) rendered with
        the chat template (for the first observation: the whole prompt, with the generation prompt).
    token_ids: ids used as they are instead of ``messages`` (e.g. the dataset's prompt in
        :class:`~tidal.envs.single_turn.SingleTurnEnv`).
    tools: tool schemas given to the chat template with the FIRST observation (the system prompt
        of Qwen2.5/Qwen3 lists them); must be None on later observations.
    An empty observation (no messages, no ids) is what a final step returns.
    """

    messages: list[Message] = dataclasses.field(default_factory=list)
    token_ids: list[int] | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def empty(self) -> bool:
        return not self.messages and not self.token_ids


@dataclasses.dataclass(kw_only=True)
class ModelTurn:
    """The model's turn as sampled.

    token_ids: the sampled ids (the stop token included when the turn ended on one).
    text: their decoding, special tokens skipped.
    finish_reason: ``stop`` (stop token) or ``length`` (the turn's token limit).
    index: 0-based turn number.
    """

    token_ids: list[int]
    text: str
    finish_reason: Literal["stop", "length"]
    index: int


@dataclasses.dataclass(kw_only=True)
class StepResult:
    """The environment's answer to a turn.

    observation: what the model sees next (ignored when done).
    reward: the outcome reward when done, else this turn's per-turn reward.
    done: the trajectory ends.
    failed: a counted failure (``env.tool_failure: drop``): the trajectory ends and leaves the loss;
        the message says why.
    counters: numbers summed into the rollout metrics as ``env/<name>`` (e.g. tool_calls).
    """

    observation: Observation = dataclasses.field(default_factory=Observation)
    reward: float = 0.0
    done: bool = False
    failed: str | None = None
    counters: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """Base class of environments; subclasses are named by import path in ``env.name``
    (``module:Class``) or registered under a short name (:mod:`tidal.envs.registry`).

    The constructor receives the ``env`` config and ``env.kwargs`` as keyword arguments.
    """

    name: str = "environment"
    # The counters its steps report (``StepResult.counters``): each one is in the rollout's metrics
    # (``env/<name>``, ``env/<name>_frac``) on every rank, also when no trajectory reported it.
    counter_names: tuple[str, ...] = ()
    # Its steps call tools (bounded by ``env.tool_timeout_s`` each) and its observations carry tool
    # schemas and results, rendered with the chat template's tool format: ``env.step_timeout_s`` must
    # outlast ``env.max_tool_calls_per_turn`` calls (:func:`~tidal.envs.config.check_step_timeout`),
    # and the rollout checks once that the tokenizer's template renders tool messages.
    uses_tools: bool = False
    # One turn decoded from the row's prompt, then done: the rollout makes exactly a plain rollout's
    # one batch ``generate`` call (same prompts, same parameters). A subclass that adds turns sets it False.
    single_turn: bool = False
    # Its episodes are driven by another library, which calls the engine itself (verifiers): the
    # rollout is the class's own (``rollout(cfg, tokenizer, max_context=...)``, with EnvRollout's
    # ``run``), not EnvRollout's turn by turn.
    drives_own_episodes: bool = False

    def __init__(self, cfg: EnvConfig, **kwargs: Any):
        if kwargs:
            raise ConfigError("env.kwargs", f"environment '{self.name}' does not take the settings {sorted(kwargs)}")
        self.cfg = cfg

    @abc.abstractmethod
    def reset(self, row: EnvRow) -> Observation:
        """The first observation: the prompt of the trajectory."""

    @abc.abstractmethod
    def step(self, turn: ModelTurn) -> StepResult:
        """React to the model's turn."""

    def close(self) -> None:
        """Release what the episode holds (called once when the trajectory ends)."""

    @classmethod
    def log_to(cls, folder: str) -> None:
        """Where the run keeps what the environment's own processes log (``RUN_DIR/env_logs/rank<r>``),
        said once per process before the first environment is built; the default logs nothing
        (an MCP server's log goes there instead of the console)."""


EnvFactory = Callable[[], Environment]


def env_class(cfg: EnvConfig) -> type[Environment]:
    """The class named by ``env.name``: a built-in or registered name, or ``module:Class``."""
    from tidal.envs.registry import named_class

    if ":" not in cfg.name:
        return named_class(cfg.name)  # its step timeout was checked with the config
    from tidal.rewards.function import load_function

    cls = load_function(cfg.name, "env.name")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError("env.name", f"'{cfg.name}' is not a subclass of tidal.envs.Environment")
    if cls.name == Environment.name:
        cls.name = cfg.name
    check_step_timeout(cfg, cls.uses_tools, "env.step_timeout_s")
    return cls


# Engines whose adapters the environment path supports (exact token ids and sampling logprobs of a
# prompt given as ids, each turn a new call on the trajectory's ids). vLLM takes prompts as ids and
# returns the sampled ids with their processed logprobs (rounds of generate calls); SGLang's adapter
# is refused (docs/agentic.md).
MULTI_TURN_BACKENDS = ("native", "hf", "vllm")


def check_engine_backend(cfg: EnvConfig, backend: str) -> None:
    """Raise ConfigError when ``env`` is a multi-turn environment and ``engine.backend`` cannot run it."""
    if cfg.name != "single_turn" and backend not in MULTI_TURN_BACKENDS:
        raise ConfigError(
            "engine.backend",
            f"env.name={cfg.name!r} is a multi-turn environment, which needs engine.backend in {list(MULTI_TURN_BACKENDS)}; "
            f"the {backend} adapter generates single completions only (its token-in/token-out across turns and its "
            "logprobs are not verified, and it has no incremental requests). Use engine.backend=native (or vllm, hf), "
            "or env.name=single_turn",
        )


def make_env_factory(cfg: EnvConfig) -> EnvFactory:
    """A callable making one fresh environment per trajectory. One instance is built at once, so a
    bad ``env.kwargs`` is a config error before any rollout."""
    cls = env_class(cfg)
    cls(cfg, **cfg.kwargs).close()
    return lambda: cls(cfg, **cfg.kwargs)
