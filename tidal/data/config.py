"""Configuration of prompt datasets (``data.*``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.config_base import check

SourceFormat = Literal["auto", "jsonl", "json", "parquet", "hf_disk"]


@dataclasses.dataclass(kw_only=True)
class DataSource:
    """One local file or folder of prompt rows (``data.train[i]`` / ``data.eval[i]``).

    path: a ``.jsonl`` file, a ``.json`` file holding a list of rows, a ``.parquet`` file, or a folder
        written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict`` folder must name the split:
        ``path/train``).
    weight: how many times each row of this source is used per epoch. 1.0 uses every row once,
        2.0 every row twice, 0.5 a seeded random half of the rows (see :class:`PromptDataset`).
    format: ``auto`` picks from the suffix (``.jsonl``, ``.json``, ``.parquet``) or, for a folder,
        ``hf_disk``.
    """

    path: str
    weight: float = 1.0
    format: SourceFormat = "auto"

    def __post_init__(self):
        check(bool(self.path), "path", "must be a non-empty path")
        check(self.weight > 0, "weight", f"must be > 0, got {self.weight}")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """How prompt rows are read, templated and tokenized (``data.*``).

    train / eval: the sources of training and held-out prompts, blended by ``weight``.
    prompt_key: row field holding a plain prompt string.
    messages_key: row field holding chat messages (a list of ``{"role", "content"}``); a row has
        exactly one of ``prompt_key`` / ``messages_key``.
    reference_key: row field with the reference answer (any JSON value; None when absent).
    label_key: row field with the recipe label (a string; "" when absent).
    image_key: row field with the images of a vision-language row (a list, or one value; None when
        absent): paths, bytes or ``{bytes, path}`` dicts. With a vision-language model's tokenizer they
        become image tokens and pixel inputs (:mod:`tidal.data.vision`); otherwise passed through unchanged.
    system_prompt: a system message put first in every chat whose messages have none.
        Requires ``apply_chat_template``.
    apply_chat_template: render prompts with the tokenizer's chat template and its generation
        prompt (assistant header). When false, ``prompt_key`` text is tokenized as is (with the
        tokenizer's own special tokens, e.g. BOS) and rows with messages are an error.
    max_prompt_len: most prompt tokens (template included).
    overlong_prompt: what to do with a longer prompt: ``error`` (raise naming file and line),
        ``drop`` (leave it out and count it in ``PromptDataset.num_dropped``) or ``left_truncate``
        (keep the last ``max_prompt_len`` tokens, so the generation prompt at the end survives).
    shuffle: shuffle the training prompts every epoch (``StatefulDistributedSampler``).
    """

    train: list[DataSource] = dataclasses.field(default_factory=list)
    eval: list[DataSource] = dataclasses.field(default_factory=list)
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    reference_key: str = "reference"
    label_key: str = "label"
    image_key: str = "images"
    system_prompt: str | None = None
    apply_chat_template: bool = True
    max_prompt_len: int = 1024
    overlong_prompt: Literal["error", "drop", "left_truncate"] = "error"
    shuffle: bool = True

    def __post_init__(self):
        keys = {
            "prompt_key": self.prompt_key,
            "messages_key": self.messages_key,
            "reference_key": self.reference_key,
            "label_key": self.label_key,
            "image_key": self.image_key,
        }
        for name, value in keys.items():
            check(bool(value), name, "must be a non-empty field name")
        seen: dict[str, str] = {}
        for name, value in keys.items():
            check(value not in seen, name, f"'{value}' is already used by {seen.get(value)}")
            seen[value] = name
        check(self.max_prompt_len >= 1, "max_prompt_len", f"must be >= 1, got {self.max_prompt_len}")
        check(
            self.system_prompt is None or self.apply_chat_template,
            "system_prompt",
            "needs apply_chat_template: true (a system prompt is a chat message)",
        )
