"""A multi-turn tool-use environment: the model calls tools until it answers without calling one.

Each turn is parsed (:func:`~tidal.envs.tool_calls.parse_turn`); every tool-call block becomes a
``tool`` message in block order: the tool's output, or an error for a malformed or invalid call.
A turn with no tool-call block is the final answer and ends the trajectory with
:meth:`ToolEnv.final_reward` (0 by default: the RewardEngine scores the answer). A failing tool is
an error observation, or with ``env.tool_failure: drop`` ends the trajectory as a counted failure.

Counters (summed into ``env/*`` metrics): ``tool_calls`` (calls run), ``tool_errors`` (invalid
calls), ``tool_failures`` (failed tools).
"""

from __future__ import annotations

import abc
from typing import Any

from tidal.envs.base import EnvRow, Environment, Message, ModelTurn, Observation, StepResult
from tidal.envs.config import EnvConfig
from tidal.envs.tool_calls import ParsedTurn, parse_turn, tool_message
from tidal.envs.tools import Tool, ToolSet


class ToolEnv(Environment):
    """Base of tool-using environments; subclasses implement :meth:`make_tools`.

    Settings (``env.kwargs``): ``system_prompt`` (put first unless the row has a system message;
    default: the class's ``default_system_prompt``), ``tools_in_prompt`` (list the tool schemas in
    the system prompt through the chat template, as Qwen2.5/Qwen3 expect; default true).
    """

    default_system_prompt: str | None = None
    counter_names = ("tool_calls", "tool_errors", "tool_failures")
    tool_messages = True

    def __init__(self, cfg: EnvConfig, *, system_prompt: str | None = None, tools_in_prompt: bool = True, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self.system_prompt = system_prompt if system_prompt is not None else self.default_system_prompt
        self.tools_in_prompt = bool(tools_in_prompt)
        self.toolset = ToolSet(self.make_tools(), timeout_s=cfg.tool_timeout_s, max_calls_per_turn=cfg.max_tool_calls_per_turn)
        self.row: EnvRow | None = None

    @abc.abstractmethod
    def make_tools(self) -> list[Tool]:
        """The tools of one episode (called once per environment instance)."""

    def final_reward(self, parsed: ParsedTurn, turn: ModelTurn) -> float:
        """The env's outcome reward for the final answer (added to the RewardEngine's score)."""
        return 0.0

    def reset(self, row: EnvRow) -> Observation:
        if row.messages is None:
            raise ValueError(f"environment '{self.name}' needs chat messages (row {row.where} has a raw-text prompt: "
                             "set data.apply_chat_template: true)")
        self.row = row
        messages: list[Message] = [dict(m) for m in row.messages]
        if self.system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Observation(messages=messages, tools=self.toolset.schemas() if self.tools_in_prompt else None)

    def step(self, turn: ModelTurn) -> StepResult:
        parsed = parse_turn(turn.text)
        if not parsed.blocks:
            zeros = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_failures": 0.0}
            return StepResult(done=True, reward=self.final_reward(parsed, turn), counters=zeros)
        results = self.toolset.run(parsed.blocks)
        counters = {
            "tool_calls": float(len(parsed.calls)),
            "tool_errors": float(sum(r.status == "error" for r in results)),
            "tool_failures": float(sum(r.status == "failure" for r in results)),
        }
        failures = [r.content for r in results if r.status == "failure"]
        if failures and self.cfg.tool_failure == "drop":
            return StepResult(done=True, failed=failures[0], counters=counters)
        return StepResult(observation=Observation(messages=[tool_message(r.content) for r in results]), counters=counters)
