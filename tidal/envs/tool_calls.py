"""Tool calls in the format of the Qwen2.5 and Qwen3 chat templates (Hermes style).

An assistant turn calls tools with blocks
``<tool_call>\\n{"name": "calculator", "arguments": {"expression": "17*23"}}\\n</tool_call>`` (one or
more, usually after some text); Qwen3 may open the turn with a ``<think>...</think>`` reasoning
block. Tool results go back as ``{"role": "tool", "content": ...}`` messages, which both templates
render as ``<tool_response>`` blocks inside a user turn (:mod:`tidal.envs.chat` appends them).

:func:`parse_turn` never raises on what the model wrote: a malformed call becomes an entry of
``ParsedTurn.errors`` that the environment returns to the model as an observation.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tidal.envs.base import Message

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(kw_only=True)
class ParsedTurn:
    """An assistant turn taken apart.

    content: the text outside the reasoning and the tool-call blocks (stripped).
    reasoning: the ``<think>`` block's text (Qwen3), None when there is none.
    blocks: one entry per tool-call block, in order: the ToolCall, or for a malformed block a
        message saying what is wrong with it.
    """

    content: str
    reasoning: str | None
    blocks: list[ToolCall | str]

    @property
    def calls(self) -> list[ToolCall]:
        return [b for b in self.blocks if isinstance(b, ToolCall)]

    @property
    def errors(self) -> list[str]:
        return [b for b in self.blocks if isinstance(b, str)]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, rest): a leading ``<think>...</think>`` block (or, when the generation prompt
    already opened it, the text up to the first ``</think>``) and what follows it."""
    if _THINK_CLOSE not in text:
        return None, text
    head, _, rest = text.partition(_THINK_CLOSE)
    stripped = head.lstrip()
    if stripped.startswith(_THINK_OPEN):
        head = stripped[len(_THINK_OPEN):]
    elif _THINK_OPEN in head:  # text before <think>: not a leading reasoning block
        return None, text
    return head.strip("\n"), rest


def _parse_call(body: str, k: int) -> ToolCall | str:
    """The call of one block, or an error message naming the block (1-based ``k``)."""
    where = f"tool call {k}"
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return f"{where} is not valid JSON ({e.msg} at char {e.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}"
    if not isinstance(obj, dict):
        return f"{where} must be a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return f"{where} has no 'name' string"
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"{where} ('{name}'): 'arguments' is a string that is not a JSON object"
    if not isinstance(args, dict):
        return f"{where} ('{name}'): 'arguments' must be a JSON object, got {type(args).__name__}"
    unknown = sorted(set(obj) - {"name", "arguments"})
    if unknown:
        return f"{where} ('{name}') has unknown keys {unknown}; only 'name' and 'arguments' are allowed"
    return ToolCall(name=name, arguments=args)


def parse_turn(text: str) -> ParsedTurn:
    """Take an assistant turn's decoded text apart (see module docstring). Calls inside the
    reasoning block are thoughts, not calls. An unclosed ``<tool_call>`` (the turn was cut, or the
    model never closed it) is an error."""
    reasoning, rest = split_reasoning(text)
    blocks: list[ToolCall | str] = []
    pieces: list[str] = []
    pos = 0
    k = 0
    for m in _CALL.finditer(rest):
        pieces.append(rest[pos:m.start()])
        pos = m.end()
        k += 1
        blocks.append(_parse_call(m.group(1), k))
    tail = rest[pos:]
    if _OPEN in tail:
        k += 1
        blocks.append(f"tool call {k} is not closed with {_CLOSE}")
        tail = tail[: tail.index(_OPEN)]
    pieces.append(tail)
    return ParsedTurn(content="".join(pieces).strip(), reasoning=reasoning, blocks=blocks)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the Qwen2.5/Qwen3 templates write one (for demonstrations and scripted turns)."""
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{_CLOSE}"


def tool_message(content: str, name: str | None = None) -> Message:
    """A tool result message (the templates render it inside ``<tool_response>``)."""
    msg: Message = {"role": "tool", "content": content}
    if name is not None:
        msg["name"] = name
    return msg


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema as the chat templates list it in the system prompt (OpenAI function format)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
