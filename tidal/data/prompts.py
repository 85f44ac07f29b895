"""Turn one raw data row into prompt text (chat template applied) plus its passthrough fields.

Contract: :func:`parse_row` maps the configured fields of a row (``DataConfig.*_key``) to a
:class:`ParsedRow`; anything malformed raises :class:`~tidal.config_base.ConfigError` at the
``data.*_key`` whose field it is, its message starting with the row's location and ending with the fix.
:func:`render` produces the exact text the model is prompted with. Tokenization and length
handling live in :mod:`tidal.data.dataset`; this module never truncates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.config_base import ConfigError
from tidal.data.config import DataConfig


@dataclasses.dataclass(kw_only=True)
class ParsedRow:
    """The mapped fields of one row. ``messages`` is None for a plain prompt rendered without template."""

    text: str | None
    messages: list[dict[str, Any]] | None
    reference: Any
    label: str
    images: list | None
    metadata: dict[str, Any]


def parse_row(where: str, row: dict[str, Any], cfg: DataConfig) -> ParsedRow:
    """Map ``row`` (read at ``where``) to a :class:`ParsedRow` following ``cfg``'s field names."""
    prompt = row.get(cfg.prompt_key)
    messages = row.get(cfg.messages_key)
    if prompt is None and messages is None:
        raise ConfigError("data.prompt_key", f"{where}: a row needs exactly one of '{cfg.prompt_key}' or '{cfg.messages_key}', "
                          f"it has neither (its fields: {', '.join(map(repr, sorted(row)))}); set data.prompt_key (a prompt "
                          "string) or data.messages_key (chat messages) to the field that holds the prompt")
    if prompt is not None and messages is not None:
        raise ConfigError("data.prompt_key", f"{where}: a row needs exactly one of '{cfg.prompt_key}' or '{cfg.messages_key}', "
                          "it has both; remove one from the data, or point data.prompt_key / data.messages_key elsewhere")
    if prompt is not None and not isinstance(prompt, str):
        raise ConfigError("data.prompt_key", f"{where}: '{cfg.prompt_key}' must be a string, got {type(prompt).__name__} "
                          "(chat messages go under data.messages_key)")
    if messages is not None:
        _check_messages(where, messages, cfg.messages_key)
        if not cfg.apply_chat_template:
            raise ConfigError("data.apply_chat_template", f"{where}: row has '{cfg.messages_key}' but data.apply_chat_template is "
                              "false; chat messages need a template")
    label = row.get(cfg.label_key)
    if label is not None and not isinstance(label, str):
        raise ConfigError("data.label_key", f"{where}: '{cfg.label_key}' must be a string (a recipe name of reward.recipes), got {label!r}")
    images = row.get(cfg.image_key)
    if images is not None and not isinstance(images, list):
        images = [images]
    if cfg.apply_chat_template:
        messages = _with_system(messages if messages is not None else [{"role": "user", "content": prompt}], cfg.system_prompt)
    mapped = {cfg.prompt_key, cfg.messages_key, cfg.reference_key, cfg.label_key, cfg.image_key}
    return ParsedRow(
        text=prompt if not cfg.apply_chat_template else None,
        messages=messages,
        reference=row.get(cfg.reference_key),
        label=label or "",
        images=images,
        metadata={k: v for k, v in row.items() if k not in mapped},
    )


def _check_messages(where: str, messages: Any, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ConfigError("data.messages_key", f"{where}: '{key}' must be a non-empty list of {{role, content}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ConfigError("data.messages_key", f"{where}: '{key}'[{i}] must be an object with a string 'role' and a 'content', got {m!r:.200}")
        content = m["content"]
        parts_ok = isinstance(content, list) and all(isinstance(c, dict) and isinstance(c.get("type"), str) for c in content)
        if not isinstance(content, str) and not parts_ok:
            raise ConfigError("data.messages_key", f"{where}: '{key}'[{i}].content must be a string or a list of {{type, ...}} parts, got {content!r:.200}")


def _with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """Put ``system_prompt`` first unless the chat already has a system message (the row's wins)."""
    if system_prompt is None or any(m["role"] == "system" for m in messages):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def require_chat_template(tokenizer: Any, cfg: DataConfig) -> None:
    """Raise ConfigError when a chat template is asked for but the tokenizer has none."""
    if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.apply_chat_template",
            "is true but the tokenizer has no chat template. Use a chat/instruct checkpoint, set "
            "tokenizer.chat_template to a Jinja template, or set data.apply_chat_template=false to "
            "tokenize the prompt text as is",
        )


def render(parsed: ParsedRow, tokenizer: Any) -> str:
    """The prompt text: the chat template with its generation prompt, or the raw prompt text."""
    if parsed.messages is None:
        assert parsed.text is not None
        return parsed.text
    return tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True, tokenize=False)


def generation_prompt_len(tokenizer: Any) -> int:
    """Tokens the template appends for ``add_generation_prompt`` (the assistant header), probed once."""
    chat = [{"role": "user", "content": "x"}]
    with_gen = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    if not with_gen.startswith(without):
        return 0
    suffix = with_gen[len(without):]
    return len(text_tokenizer(tokenizer)(suffix, add_special_tokens=False)["input_ids"]) if suffix else 0


def text_tokenizer(tokenizer: Any) -> Any:
    """The text tokenizer (a multimodal processor's ``.tokenizer``, else the tokenizer itself)."""
    return getattr(tokenizer, "tokenizer", tokenizer)
