"""Configuration of environments and tools (``env.*``).

One environment class per run, chosen by ``env.name``; the limits below apply to every trajectory
whatever the environment. The default, ``single_turn``, is today's rollout as the one-turn special
case of the same path: the dataset's prompt, one sampled turn, done.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from tidal.config_base import check, check_choice


@dataclasses.dataclass(kw_only=True)
class SandboxConfig:
    """The sandboxed Python tool (``env.sandbox.*``, :mod:`tidal.envs.sandbox`): each call runs the
    code in a fresh ``python -I -S`` subprocess, in an empty temporary directory, with a minimal
    environment, killed with its whole process group at ``env.tool_timeout_s`` (wall clock).

    cpu_seconds: RLIMIT_CPU of the child (CPU seconds; the kernel kills it past the limit).
    memory_mb: RLIMIT_AS of the child (address space, MiB); allocations past it raise MemoryError.
    file_mb: RLIMIT_FSIZE (largest file the code may write, MiB).
    max_output_chars: characters of stdout + stderr returned to the model; the rest is cut with a
        note saying how much was left out.
    network: ``isolate``: the child enters new user and network namespaces (no interface but a
        loopback that is down, so every connection fails); if the kernel refuses (unprivileged user
        namespaces disabled), the tool refuses to start with an error saying so. ``allow``: no
        network isolation (only for trusted code: documented in docs/agentic.md).
    python: the interpreter to run (``""``: the one running Tidal).
    """

    cpu_seconds: int = 10
    memory_mb: int = 1024
    file_mb: int = 16
    max_output_chars: int = 4000
    network: Literal["isolate", "allow"] = "isolate"
    python: str = ""

    def __post_init__(self):
        check(self.cpu_seconds >= 1, "cpu_seconds", "must be >= 1")
        check(self.memory_mb >= 64, "memory_mb", "must be >= 64 (the interpreter itself needs tens of MiB)")
        check(self.file_mb >= 0, "file_mb", "must be >= 0")
        check(self.max_output_chars >= 100, "max_output_chars", "must be >= 100")
        check_choice(self.network, ("isolate", "allow"), "network")


@dataclasses.dataclass(kw_only=True)
class EnvConfig:
    """The environment of the rollouts (``env.*``), see docs/agentic.md.

    name: a registered environment (``single_turn``, ``calculator``, ``python``) or the import path
        of your own :class:`~tidal.envs.base.Environment` subclass (``my_pkg.envs:MyEnv``).
    kwargs: keyword arguments given to the environment's constructor (your own environment's
        settings; the built-in ones take none except those documented on their class).
    max_turns: most model turns per trajectory; a trajectory still going after its last allowed
        turn ends with finish reason ``max_turns``.
    max_tokens_per_turn: most tokens sampled in one turn (0: the sampler's ``max_new_tokens``).
    max_total_tokens: most tokens after the prompt, sampled and observation tokens together (0: no
        limit but max_turns and the model's context). Each turn may sample at most what is left; an
        observation that would leave no room for one more sampled token ends the trajectory
        (``max_total_tokens``). The model's context (``max_position_embeddings``) bounds every
        trajectory the same way whatever this says (:mod:`tidal.envs.rollout`), and
        ``data.max_prompt_len`` + this must fit it (checked before the run).
    tool_timeout_s: wall-clock limit of one tool call; a call past it is a tool failure.
    step_timeout_s: wall-clock limit of one ``reset`` or ``step`` call of the environment (its tool
        calls included), counted from when it starts running; past it the call is an environment
        error (see ``on_error``). For an environment that calls tools it must exceed
        ``max_tool_calls_per_turn * tool_timeout_s``.
    tool_failure: what a failing tool (it raised, timed out or hit a sandbox limit) does:
        ``observation``: the model sees an error message as the tool's output and goes on;
        ``drop``: the trajectory ends, is counted (``env/tool_failure_drops``) and leaves the loss.
        A malformed or invalid tool call by the model is always an observation.
    max_tool_calls_per_turn: tool calls executed per turn; further calls in the same turn get an
        error observation instead of running.
    workers: threads that run environment steps (and so tool calls) while the engine decodes.
    lockstep: each round of turns waits for every environment step before any next turn is
        decoded (the engine idles while the slowest step of a round runs; in a rollout TP group,
        each rank's round waits for that rank's steps). Reproducibility does not
        need it on the native engine: each token's random number is keyed by (seed, trajectory,
        position), so two runs with the same ``run.seed`` sample the same trajectories whatever the
        tools' timing, lockstep or not. Engines without incremental requests (``hf``, vLLM, SGLang)
        decode in rounds of batch ``generate`` calls whose draws depend on the round's batch: there
        lockstep is what makes rollouts reproducible.
    on_error: an environment whose ``reset``/``step`` raises or times out: ``raise`` stops the run
        with an error naming the environment, the row and the turn; ``drop`` ends that trajectory,
        counts it (``env/errors``) and leaves it out of the loss.
    history: how the next turn sees the earlier ones. ``append``: the trajectory is one token
        sequence (prompt, turn 1, observation 1, turn 2, ...); nothing is retokenized and the
        prefix cache reuses every earlier turn. ``template``: before each turn after the first, the
        whole conversation is rendered again with the chat template, which may rewrite earlier
        turns (Qwen3 drops the ``<think>`` blocks of earlier turns); each turn is then its own row
        whose prompt is that rendering (exact token-in/token-out per row; see docs/agentic.md).
    chat_template_kwargs: extra variables for the chat template when rendering prompts and
        observations (e.g. ``{enable_thinking: false}`` for Qwen3).
    sandbox: the sandboxed Python tool's limits (:class:`SandboxConfig`).
    """

    name: str = "single_turn"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int = 8
    max_tokens_per_turn: int = 0
    max_total_tokens: int = 0
    tool_timeout_s: float = 10.0
    step_timeout_s: float = 60.0
    tool_failure: Literal["observation", "drop"] = "observation"
    max_tool_calls_per_turn: int = 4
    workers: int = 8
    lockstep: bool = False
    on_error: Literal["raise", "drop"] = "raise"
    history: Literal["append", "template"] = "append"
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

    def __post_init__(self):
        from tidal.envs.registry import known_names, named_class

        check(bool(self.name), "name", "must name an environment")
        if ":" not in self.name:
            check_choice(self.name, known_names(), "name")
        check(self.max_turns >= 1, "max_turns", "must be >= 1")
        check(self.max_tokens_per_turn >= 0, "max_tokens_per_turn", "must be >= 0 (0: the sampler's max_new_tokens)")
        check(self.max_total_tokens >= 0, "max_total_tokens", "must be >= 0 (0: no limit)")
        check(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0")
        check(self.step_timeout_s > 0, "step_timeout_s", "must be > 0")
        check(self.max_tool_calls_per_turn >= 1, "max_tool_calls_per_turn", "must be >= 1")
        check(self.workers >= 1, "workers", "must be >= 1")
        if ":" not in self.name:  # an environment named by import path is checked when it is imported (envs.base.env_class)
            check_step_timeout(self, named_class(self.name, "name").uses_tools)
        check_choice(self.tool_failure, ("observation", "drop"), "tool_failure")
        check_choice(self.on_error, ("raise", "drop"), "on_error")
        check_choice(self.history, ("append", "template"), "history")
        check(all(isinstance(k, str) for k in self.kwargs), "kwargs", "keys must be strings")
        check(all(isinstance(k, str) for k in self.chat_template_kwargs), "chat_template_kwargs", "keys must be strings")


def check_step_timeout(cfg: EnvConfig, uses_tools: bool, key: str = "step_timeout_s") -> None:
    """An environment that calls tools needs ``step_timeout_s > max_tool_calls_per_turn x
    tool_timeout_s``, or a step whose tools all run to their limit would count as an environment
    error; one without tools has no such bound. ``key``: the name the error gives the setting."""
    check(
        not uses_tools or cfg.step_timeout_s > cfg.max_tool_calls_per_turn * cfg.tool_timeout_s,
        key,
        f"must exceed max_tool_calls_per_turn x tool_timeout_s ({cfg.max_tool_calls_per_turn} x {cfg.tool_timeout_s:g} s) "
        f"for environment {cfg.name!r}, which calls tools, or a step whose tools all run to their limit would count as an "
        "environment error",
    )
