"""Turn one raw preference row into the two texts a reward model scores.

Row conventions (field names from ``data.prompt_key`` / ``data.messages_key`` and
``reward_model.chosen_key`` / ``rejected_key``; shown with the defaults):

- explicit prompt: ``prompt`` (a string, or a list of chat messages as TRL writes it) or
  ``messages`` (chat messages), plus ``chosen`` / ``rejected``, each a string or a list holding
  one assistant message ``[{"role": "assistant", "content": "..."}]``;
- implicit prompt, conversations: no prompt field; ``chosen`` and ``rejected`` are whole chats
  that share their first messages (the prompt) and differ in their last, an assistant message
  (the response);
- conversations with a prompt field (UltraFeedback-binarized): as the implicit form, the prompt field
  being the shared prompt's messages or its last message's text (else a bad row);
- implicit prompt, strings: no prompt field; ``chosen`` / ``rejected`` are strings, scored as
  they are (no template, no separator).

A sequence is ``prompt_text + separator + response`` with ``prompt_text`` rendered by
:func:`tidal.data.prompts.render` (the chat template with its generation prompt, the system prompt
added) -- the text an RL run gives its reward model as ``RewardSample.prompt`` -- and ``response``
the reply's plain text, as the RL run decodes a response (special tokens skipped). Anything
malformed raises :class:`BadPair` whose message starts with the row's location; an identical
chosen and rejected reply is a :class:`BadPair` of kind ``identical``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.data.config import DataConfig
from tidal.data.prompts import parse_row, render
from tidal.rm.config import RewardModelConfig


class BadPair(ValueError):
    """A row that is not a usable preference pair. ``kind``: ``malformed`` or ``identical``."""

    def __init__(self, message: str, kind: str = "malformed"):
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass(kw_only=True, frozen=True)
class PairTexts:
    """The two full texts of one pair (prompt, separator and response), as scored."""

    chosen: str
    rejected: str


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _reply(where: str, value: Any, key: str) -> str:
    """The text of a reply given as a string or as a one-message assistant list."""
    if isinstance(value, str):
        return value
    if _is_chat(value) and len(value) == 1:
        return _assistant_text(where, value[0], key)
    raise BadPair(f"{where}: '{key}' must be a string or a list holding one assistant message, got {_describe(value)}")


def _assistant_text(where: str, message: dict, key: str) -> str:
    if message.get("role") != "assistant" or not isinstance(message.get("content"), str):
        raise BadPair(f"{where}: the response in '{key}' must be an assistant message with string content, got {message!r}")
    return message["content"]


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (missing)"
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)"
    return type(value).__name__


def _split_conversations(where: str, chosen: list, rejected: list, keys: tuple[str, str]) -> tuple[list, str, str]:
    """(shared prompt messages, chosen reply, rejected reply) of two whole chats."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise BadPair(f"{where}: '{keys[0]}' and '{keys[1]}' share no first messages, so there is no prompt; "
                      "give the prompt in its own field")
    rest_c, rest_r = chosen[n:], rejected[n:]
    if len(rest_c) != 1 or len(rest_r) != 1:
        if not rest_c and not rest_r:
            raise BadPair(f"{where}: '{keys[0]}' and '{keys[1]}' are the same conversation", kind="identical")
        raise BadPair(f"{where}: after the {n} shared prompt message(s), '{keys[0]}' has {len(rest_c)} and "
                      f"'{keys[1]}' has {len(rest_r)} message(s); each must end in exactly one assistant reply")
    return chosen[:n], _assistant_text(where, rest_c[0], keys[0]), _assistant_text(where, rest_r[0], keys[1])


def _check_same_prompt(where: str, row: dict, messages: list, data: DataConfig, keys: tuple[str, str]) -> None:
    """A row with a prompt field AND whole conversations (as UltraFeedback-binarized writes them):
    the field must be the conversations' shared prompt (its messages, or its last message's text)."""
    given = row[data.prompt_key] if data.prompt_key in row else row[data.messages_key]
    if given != messages and given != messages[-1].get("content"):
        raise BadPair(f"{where}: the prompt field differs from the prompt that the conversations in '{keys[0]}' and "
                      f"'{keys[1]}' share; leave it out or make them agree")


def _prompt_text(where: str, row: dict, data: DataConfig, tokenizer: Any) -> str:
    """The rendered prompt of a row with an explicit prompt (``parse_row`` validates and templates it)."""
    prompt = row.get(data.prompt_key)
    if _is_chat(prompt) and data.messages_key not in row:  # TRL's conversational explicit prompt
        row = {k: v for k, v in row.items() if k != data.prompt_key} | {data.messages_key: prompt}
    try:
        parsed = parse_row(where, row, data)
    except ValueError as e:
        raise BadPair(str(e)) from None
    if parsed.images is not None:
        raise BadPair(f"{where}: has '{data.image_key}'; reward-model training on images is not supported")
    return render(parsed, tokenizer)


def pair_texts(where: str, row: dict[str, Any], data: DataConfig, rm: RewardModelConfig, tokenizer: Any) -> PairTexts:
    """The scored texts of ``row`` (read at ``where``); see the module docstring. Raises BadPair."""
    keys = (rm.chosen_key, rm.rejected_key)
    chosen, rejected = row.get(rm.chosen_key), row.get(rm.rejected_key)
    for key, value in zip(keys, (chosen, rejected)):
        if value is None or value == "" or value == []:
            raise BadPair(f"{where}: '{key}' is missing or empty")
    has_prompt = data.prompt_key in row or data.messages_key in row
    if _is_chat(chosen) and _is_chat(rejected) and (len(chosen) > 1 or len(rejected) > 1 or not has_prompt):
        messages, c, r = _split_conversations(where, chosen, rejected, keys)
        if has_prompt:
            _check_same_prompt(where, row, messages, data, keys)
        prompt = _prompt_text(where, {data.messages_key: messages}, data, tokenizer)
        texts = (c, r)
        full = (prompt + rm.separator + c, prompt + rm.separator + r)
    elif has_prompt:
        prompt = _prompt_text(where, row, data, tokenizer)
        texts = (_reply(where, chosen, keys[0]), _reply(where, rejected, keys[1]))
        full = tuple(prompt + rm.separator + t for t in texts)
    elif isinstance(chosen, str) and isinstance(rejected, str):
        texts = full = (chosen, rejected)
    else:
        raise BadPair(f"{where}: with no '{data.prompt_key}' or '{data.messages_key}', '{keys[0]}' and '{keys[1]}' "
                      f"must both be strings or both be conversations, got {_describe(chosen)} and {_describe(rejected)}")
    if texts[0] == texts[1]:
        raise BadPair(f"{where}: '{keys[0]}' and '{keys[1]}' are the same response", kind="identical")
    return PairTexts(chosen=full[0], rejected=full[1])
