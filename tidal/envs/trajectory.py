"""Trajectories as exact token sequences (token-in/token-out).

A trajectory is built by APPENDING: the prompt's ids, then each turn's ids exactly as the engine
sampled them (with their sampling logprobs), then each observation's ids as the chat template
rendered them. No token is ever re-encoded, so the trainer scores exactly the tokens the engine
sampled, in exactly the context the engine saw them in.

Rows: with ``env.history: append`` a trajectory is one row. With ``history: template`` every turn
after the first starts a new row whose prompt is the whole conversation rendered again by the chat
template (which may rewrite earlier turns, e.g. drop their ``<think>`` blocks): each row is then
exact, and :mod:`tidal.algorithms.trajectory_rows` lays the rows end to end for the advantages.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from tidal.envs.base import EnvRow, Message, ModelTurn
from tidal.rewards.types import RewardSample

FinishReason = Literal["done", "max_turns", "max_total_tokens", "tool_failure", "env_error"]
FINISH_REASONS: tuple[str, ...] = typing.get_args(FinishReason)


@dataclasses.dataclass(kw_only=True)
class TrajectoryRow:
    """One token sequence: ``prompt_ids`` then ``token_ids`` (everything after the prompt).
    ``action_mask[i]`` is 1 where ``token_ids[i]`` was sampled by the model and 0 on observation
    tokens; ``logprobs[i]`` is its sampling logprob (0.0 on observation tokens).
    ``routed_experts``: MoE models, the engine's routing of ``input_ids[:len(routed_experts)]``
    (``Completion.routed_experts`` of the row's last turn, whose prompt was the row so far; int16
    ``[n, L, K]``), None when the engine recorded none.
    ``versions[i]``: the policy version whose weights sampled ``token_ids[i]`` (the engine's
    ``Completion.versions``; 0 from an engine that does not track them), -1 on observation tokens:
    a trajectory kept in flight across rollouts (``rollout.partial.mode: carry``) has turns, even
    parts of one turn, sampled by different weights, each token's ``logprobs[i]`` being that of
    the weights that sampled it."""

    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routed_experts: Any = None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    @property
    def num_sampled(self) -> int:
        return sum(self.action_mask)


@dataclasses.dataclass(kw_only=True)
class TurnRecord:
    """Where turn ``index`` sits: row ``row``, sampled tokens ``token_ids[start : start +
    num_sampled]`` of that row, followed by ``num_observation`` observation tokens. ``reward`` is
    its per-turn reward (the final turn's outcome reward is ``Trajectory.outcome_reward``)."""

    index: int
    row: int
    start: int
    num_sampled: int
    text: str
    finish_reason: Literal["stop", "length"]
    num_observation: int = 0
    reward: float = 0.0


@dataclasses.dataclass(kw_only=True)
class Trajectory:
    """A finished trajectory.

    rows / turns: the token sequences and where each turn sits in them.
    messages: the conversation (the row's messages, then ``assistant`` turns with their decoded
        text and the observations' messages), as reward functions receive it.
    outcome_reward: the environment's reward at its final step (0 when it ended otherwise).
    finish_reason: ``done`` (the environment ended it), ``max_turns``, ``max_total_tokens``,
        ``tool_failure`` (a failing tool with ``env.tool_failure: drop``), ``env_error`` (the
        environment raised or timed out, ``env.on_error: drop``).
    valid: False when it must leave the loss (tool_failure, env_error); error says why.
    counters: the environment's counters summed over its steps.
    row / group_id: the data row and the prompt group (the n trajectories of one row share it).
    """

    rows: list[TrajectoryRow]
    turns: list[TurnRecord]
    messages: list[Message]
    finish_reason: FinishReason
    row: EnvRow
    group_id: int
    outcome_reward: float = 0.0
    valid: bool = True
    error: str | None = None
    counters: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(r.num_sampled for r in self.rows)

    @property
    def num_response_tokens(self) -> int:
        """Tokens after the first prompt: sampled and observation tokens (the budget of
        ``env.max_total_tokens``)."""
        return sum(t.num_sampled + t.num_observation for t in self.turns)

    @property
    def sampled_versions(self) -> list[int]:
        """The policy version of every sampled token, in order (``TrajectoryRow.versions``)."""
        return sampled_versions(self.rows)

    @property
    def truncated(self) -> bool:
        """Cut by a limit: it ended at ``max_turns`` or ``max_total_tokens``, or its last turn hit
        its token limit (for one turn: exactly a plain completion's ``finish_reason == "length"``)."""
        cut_turn = bool(self.turns) and self.turns[-1].finish_reason == "length"
        return self.finish_reason in ("max_turns", "max_total_tokens") or cut_turn

    def turn_ids(self, turn: TurnRecord) -> list[int]:
        return self.rows[turn.row].token_ids[turn.start : turn.start + turn.num_sampled]

    def reward_sample(self, index: int) -> RewardSample:
        """What the RewardEngine scores: ``response`` is the FINAL turn's text (for a single turn,
        exactly today's response), ``messages`` the whole conversation."""
        if not self.turns:
            raise ValueError(f"trajectory of row {self.row.where} has no turn to score ({self.finish_reason}: {self.error})")
        last = self.turns[-1]
        return RewardSample(
            prompt=self.row.prompt_text, response=last.text, prompt_ids=list(self.rows[0].prompt_ids),
            response_ids=self.turn_ids(last), reference=self.row.reference, label=self.row.label,
            metadata=dict(self.row.metadata), finish_reason=last.finish_reason, index=index,
            messages=[dict(m) for m in self.messages],
        )


def sampled_versions(rows: list[TrajectoryRow]) -> list[int]:
    """The policy versions of the sampled tokens of ``rows``, in order."""
    return [v for r in rows for v, a in zip(r.versions, r.action_mask) if a]


class TrajectoryBuilder:
    """Builds one trajectory by appending (see module docstring)."""

    def __init__(self, prompt_ids: list[int], messages: list[Message] | None = None):
        if not prompt_ids:
            raise ValueError("a trajectory needs a non-empty prompt")
        self.rows = [TrajectoryRow(prompt_ids=list(prompt_ids))]
        self.turns: list[TurnRecord] = []
        self.messages: list[Message] = [dict(m) for m in messages or []]

    @property
    def context_ids(self) -> list[int]:
        """What the engine continues for the next turn: the current row's prompt and tokens."""
        return self.rows[-1].input_ids

    @property
    def num_response_tokens(self) -> int:
        return sum(t.num_sampled + t.num_observation for t in self.turns)

    def add_turn(self, token_ids: list[int], logprobs: list[float], finish_reason: Literal["stop", "length"], text: str,
                 routed_experts=None, versions: list[int] | None = None) -> ModelTurn:
        """Append the engine's sampled ids (mask 1) with their logprobs, exactly as given;
        ``routed_experts``: the completion's (MoE), which covers the row so far and the new ids;
        ``versions``: the policy version of each id (None: 0 for all, an engine that does not track them)."""
        if not token_ids or len(token_ids) != len(logprobs):
            raise ValueError(f"a turn needs >= 1 sampled token and one logprob per token, got {len(token_ids)} and {len(logprobs)}")
        if versions is not None and len(versions) != len(token_ids):
            raise ValueError(f"a turn needs one policy version per token, got {len(versions)} for {len(token_ids)} tokens")
        row = self.rows[-1]
        self.turns.append(TurnRecord(index=len(self.turns), row=len(self.rows) - 1, start=len(row.token_ids),
                                     num_sampled=len(token_ids), text=text, finish_reason=finish_reason))
        row.token_ids += token_ids
        row.action_mask += [1] * len(token_ids)
        row.logprobs += [float(x) for x in logprobs]
        row.versions += [int(v) for v in versions] if versions is not None else [0] * len(token_ids)
        row.routed_experts = routed_experts
        self.messages.append({"role": "assistant", "content": text})
        return ModelTurn(token_ids=list(token_ids), text=text, finish_reason=finish_reason, index=len(self.turns) - 1)

    def add_observation(self, token_ids: list[int], messages: list[Message]) -> None:
        """Append an observation's ids (mask 0) after the last turn, and its messages."""
        if not self.turns:
            raise ValueError("an observation follows a turn (the first observation is the prompt)")
        row = self.rows[-1]
        row.token_ids += token_ids
        row.action_mask += [0] * len(token_ids)
        row.logprobs += [0.0] * len(token_ids)
        row.versions += [-1] * len(token_ids)
        self.turns[-1].num_observation += len(token_ids)
        self.messages += [dict(m) for m in messages]

    def count_observation(self, num_tokens: int, messages: list[Message]) -> None:
        """Record an observation that the next row's re-rendered prompt carries (``history:
        template``): it counts in the budget and the conversation, no token is appended here."""
        self.turns[-1].num_observation += num_tokens
        self.messages += [dict(m) for m in messages]

    def new_row(self, prompt_ids: list[int]) -> None:
        """Start a new row whose prompt is the re-rendered conversation (``history: template``)."""
        if not prompt_ids:
            raise ValueError("a row needs a non-empty prompt")
        self.rows.append(TrajectoryRow(prompt_ids=list(prompt_ids)))

    def set_turn_reward(self, reward: float) -> None:
        self.turns[-1].reward = float(reward)

    def finish(self, *, row: EnvRow, group_id: int, finish_reason: FinishReason, outcome_reward: float = 0.0,
               valid: bool = True, error: str | None = None, counters: dict[str, Any] | None = None) -> Trajectory:
        return Trajectory(rows=self.rows, turns=self.turns, messages=self.messages, finish_reason=finish_reason,
                          row=row, group_id=group_id, outcome_reward=float(outcome_reward), valid=valid, error=error,
                          counters=dict(counters or {}))
