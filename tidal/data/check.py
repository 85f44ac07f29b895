"""Read a sample of every data source against the config, before any model loads.

``tidal check`` and ``tidal train`` run the same check (:func:`tidal.inputs.check_data` calls
:func:`sample_rows` for every source): each sampled row is parsed with the run's field names
(:func:`~tidal.data.prompts.parse_row`), rendered with its chat template and tokenized, and prompts
longer than ``data.max_prompt_len`` are an error when ``data.overlong_prompt`` is ``error`` (one,
after the whole sample: how many rows are over, the longest, and the value that fits). Every
failure is a :class:`~tidal.config_base.ConfigError` naming the file and row, the key and the fix.
The sample is the first :data:`HEAD_ROWS` rows and :data:`SPREAD_ROWS` more spread evenly over the
rest, so a check takes about as long on a large source as on a small one; the whole data is read
(and every row checked) when the run loads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tidal.config_base import ConfigError
from tidal.data.config import DataConfig, DataSource
from tidal.data.loaders import load_rows
from tidal.data.prompts import ParsedRow, parse_row, render, text_tokenizer

HEAD_ROWS = 32
SPREAD_ROWS = 96


@dataclasses.dataclass(kw_only=True)
class SampledRow:
    """One checked row: where it is, its mapped fields, and its prompt's tokens (None for a row
    with images, whose image tokens the vision processor adds when the data loads)."""

    where: str
    parsed: ParsedRow
    prompt_tokens: int | None


def sample_indices(n: int) -> list[int]:
    """The rows checked of a source with ``n`` rows: the first HEAD_ROWS, then SPREAD_ROWS evenly
    spaced over the rest (the last row included)."""
    head = list(range(min(n, HEAD_ROWS)))
    rest = n - len(head)
    if rest <= SPREAD_ROWS:
        return head + list(range(len(head), n))
    return head + sorted({len(head) + (rest - 1) * k // (SPREAD_ROWS - 1) for k in range(SPREAD_ROWS)})


def sample_rows(source: DataSource, cfg: DataConfig, tokenizer: Any, *, key: str, room: int | None = None,
                every_row: bool = False) -> list[SampledRow]:
    """The checked sample of ``source`` (``key``: its config key, e.g. ``data.train[0]``), or all of
    its rows with ``every_row`` (a generated source, cheap to read whole). ``room``: the most prompt
    tokens the model leaves (:func:`check_prompt_lengths`)."""
    try:
        rows = load_rows(source)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}.path", str(e)) from None
    if not rows:
        raise ConfigError(f"{key}.path", f"{source.path}: holds no rows")
    picked = rows if every_row else [rows[i] for i in sample_indices(len(rows))]
    out = []
    for where, row in picked:
        parsed = parse_row(where, row, cfg)
        tokens = None if parsed.images else _prompt_tokens(where, parsed, cfg, tokenizer)
        out.append(SampledRow(where=where, parsed=parsed, prompt_tokens=tokens))
    if cfg.overlong_prompt == "error":
        check_prompt_lengths(source.path, [(r.where, r.prompt_tokens) for r in out if r.prompt_tokens is not None],
                             cfg.max_prompt_len, of=f"the {len(out)} rows checked" + ("" if len(out) == len(rows) else f" (of {len(rows)})"),
                             room=room)
    return out


def check_prompt_lengths(path: str, lengths: list[tuple[str, int]], limit: int, *, of: str, room: int | None = None) -> None:
    """ConfigError at ``data.max_prompt_len`` when any prompt of ``lengths`` ((where, tokens) of
    ``of``, e.g. ``the 128 rows checked``) is longer than ``limit``: how many, the longest, and what
    to do. ``room``: the most prompt tokens the model leaves (its positions less
    ``rollout.max_new_tokens``; None: unknown); a ``data.max_prompt_len`` past it is never advised."""
    over = [(where, n) for where, n in lengths if n > limit]
    if not over:
        return
    where, n = max(over, key=lambda item: item[1])
    said = f"{path}: {len(over)} of {of} have a prompt longer than data.max_prompt_len={limit} tokens; the longest, {where}, has {n}"
    if room is not None and n > room:
        fit = sum(1 for _, m in lengths if m <= room)
        raise ConfigError("data.max_prompt_len", f"{said}, more than the model's positions leave after rollout.max_new_tokens "
                          f"({room}; {fit} of {of} fit): set data.overlong_prompt to drop or left_truncate, or give shorter "
                          "prompts (a reasoning-gym dataset's settings) or a model with more positions")
    raise ConfigError("data.max_prompt_len", f"{said}: set data.max_prompt_len={n} to fit them, or data.overlong_prompt to drop or "
                      "left_truncate")


def _prompt_tokens(where: str, parsed: ParsedRow, cfg: DataConfig, tokenizer: Any) -> int:
    """Tokens of the rendered prompt, as the dataset counts them."""
    try:
        text = render(parsed, tokenizer)
    except Exception as e:  # noqa: BLE001 -- jinja raises anything the row's values provoke
        raise ConfigError("data.messages_key", f"{where}: the chat template cannot render this row ({type(e).__name__}: {e})") from None
    return len(text_tokenizer(tokenizer)(text, add_special_tokens=not cfg.apply_chat_template)["input_ids"])
