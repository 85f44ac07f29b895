"""Prompt datasets: every source loaded, templated and tokenized once, then blended by weight.

Blending (exact rule). Let source ``s`` keep ``k_s`` rows after overlong handling and have weight
``w_s``. It contributes ``c_s = round(w_s * k_s)`` entries to the dataset: ``c_s // k_s`` copies of
every row, plus ``c_s mod k_s`` distinct rows drawn without replacement (kept in file order) by a
``numpy.random.default_rng(seed)`` shared by the sources in config order. The dataset is the
concatenation of the sources' entries in config order; ``len()`` is ``sum(c_s)``. The draw is fixed
for the run (it depends only on ``seed`` and the data); the per-epoch shuffling is the sampler's job.
So weight 1 uses each row once per epoch, 2 twice, 0.5 a fixed half.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any, Sequence

import numpy as np

from tidal.config_base import ConfigError
from tidal.data.check import check_prompt_lengths
from tidal.data.config import DataConfig, DataSource
from tidal.data.loaders import load_rows
from tidal.data.prompts import ParsedRow, generation_prompt_len, parse_row, render, require_chat_template, text_tokenizer
from tidal.data.vision import expand_image_rows, image_inputs, place_row_images

_TOKENIZE_CHUNK = 1024


@dataclasses.dataclass(kw_only=True)
class PromptItem:
    """One prompt as the trainer sees it.

    prompt_ids: token ids given to the engine (template and generation prompt included).
    prompt_text: the exact text those ids decode from (after any left truncation).
    reference: the row's reference answer (any JSON value) or None.
    label: the row's recipe label, "" when absent.
    metadata: every other field of the row (a fresh copy per access).
    images: the row's images, passed through unchanged, or None.
    source: the path of the source the row came from; row: its 0-based row index in that source.
    mm_inputs: the pixel inputs of the row's images (``pixel_values``, ``image_grid_thw``; see
        :mod:`tidal.models.vision`), computed on access, and ``prompt_ids`` then hold each image's
        tokens; None for a text row, or when the tokenizer is a text tokenizer (no image processor).
    messages: the chat messages the prompt was rendered from (``data.system_prompt`` included; a
        fresh copy per access), or None for a raw-text prompt (``data.apply_chat_template: false``).
        Multi-turn environments (:mod:`tidal.envs`) continue the conversation from them.
    """

    prompt_ids: list[int]
    prompt_text: str
    reference: Any
    label: str
    metadata: dict[str, Any]
    images: list | None
    source: str
    row: int
    mm_inputs: dict | None = None
    messages: list[dict[str, Any]] | None = None


@dataclasses.dataclass(kw_only=True)
class _Kept:
    parsed: ParsedRow
    text: str
    source: str
    row: int


def _render(where: str, parsed: ParsedRow, tokenizer: Any) -> str:
    """:func:`render`, with a failure of the chat template on this row named by file and line."""
    try:
        return render(parsed, tokenizer)
    except Exception as e:  # noqa: BLE001 -- jinja raises anything the row's values provoke
        raise ValueError(f"{where}: the chat template cannot render this row ({type(e).__name__}: {e})") from None


class PromptDataset:
    """All prompt rows of ``sources``, tokenized with ``tokenizer`` under ``cfg`` (see module docstring).

    Attributes: ``num_rows`` distinct rows kept, ``num_dropped`` overlong rows left out
    (``overlong_prompt: drop``), ``num_truncated`` rows left-truncated (``left_truncate``).
    Raises ValueError naming file and line for a malformed row or (``overlong_prompt: error``) an
    overlong prompt, and ConfigError when a chat template is needed but missing.
    """

    def __init__(self, sources: Sequence[DataSource], tokenizer: Any, cfg: DataConfig, *, seed: int):
        if not sources:
            raise ValueError("no data sources given (set data.train / data.eval)")
        require_chat_template(tokenizer, cfg)
        self._tokenizer = tokenizer
        self._cfg = cfg
        if cfg.overlong_prompt == "left_truncate" and cfg.apply_chat_template:
            gen_len = generation_prompt_len(tokenizer)
            if cfg.max_prompt_len <= gen_len:
                raise ConfigError("data.max_prompt_len", f"must exceed the {gen_len} tokens of the generation prompt to left-truncate")
        self.num_dropped = 0
        self.num_truncated = 0
        self._kept: list[_Kept] = []
        ids_parts: list[np.ndarray] = []
        per_source: list[np.ndarray] = []
        for source in sources:
            start = len(self._kept)
            ids_parts.extend(self._load_source(source))
            per_source.append(np.arange(start, len(self._kept)))
        self._ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
        lengths = np.array([len(p) for p in ids_parts], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._index = blend_index(sources, per_source, seed)

    @property
    def num_rows(self) -> int:
        return len(self._kept)

    @property
    def content_hash(self) -> str:
        """What this dataset serves, in order (:func:`content_hash`: every prompt's token ids, the
        blend, and each row's reference, label and metadata): a resume compares it with the
        checkpoint's, so rows changed or reordered under the same count are found."""
        fields = json.dumps([[k.parsed.reference, k.parsed.label, k.parsed.metadata] for k in self._kept], sort_keys=True, default=str)
        return content_hash(self._ids, self._offsets, self._index, fields.encode())

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> PromptItem:
        if not -len(self) <= i < len(self):
            raise IndexError(f"prompt index {i} out of range for {len(self)} prompts")
        k = int(self._index[i])
        kept = self._kept[k]
        ids = self._ids[self._offsets[k] : self._offsets[k + 1]].tolist()
        return PromptItem(
            prompt_ids=ids,
            prompt_text=kept.text,
            reference=kept.parsed.reference,
            label=kept.parsed.label,
            metadata=dict(kept.parsed.metadata),
            images=kept.parsed.images,
            source=kept.source,
            row=kept.row,
            mm_inputs=image_inputs(self._tokenizer, kept.parsed.images, kept.source),
            messages=copy.deepcopy(kept.parsed.messages),
        )

    def _load_source(self, source: DataSource) -> list[np.ndarray]:
        """Parse, render and tokenize one source; append kept rows; return their token ids."""
        rows = load_rows(source)
        parsed = [place_row_images(where, parse_row(where, row, self._cfg), self._cfg, self._tokenizer) for where, row in rows]
        texts = [_render(where, p, self._tokenizer) for (where, _row), p in zip(rows, parsed)]
        ids_list = self._tokenize(texts)
        ids_list = expand_image_rows(self._tokenizer, self._cfg, source.path, [w for w, _ in rows], parsed, texts, ids_list)
        if self._cfg.overlong_prompt == "error":  # every row over the limit, counted, before any is kept
            check_prompt_lengths(source.path, [(where, len(ids)) for (where, _row), ids in zip(rows, ids_list)],
                                 self._cfg.max_prompt_len, of=f"its {len(rows)} rows")
        out = []
        for row_index, ((where, _row), p, text, ids) in enumerate(zip(rows, parsed, texts, ids_list)):
            fitted = self._fit(where, ids)
            if fitted is None:
                continue
            if len(fitted) < len(ids):
                text = text_tokenizer(self._tokenizer).decode(fitted.tolist(), skip_special_tokens=False)
            self._kept.append(_Kept(parsed=p, text=text, source=source.path, row=row_index))
            out.append(fitted)
        return out

    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        # A rendered template already holds its special tokens; a raw prompt gets the tokenizer's own (BOS).
        tok = text_tokenizer(self._tokenizer)
        add_special = not self._cfg.apply_chat_template
        out = []
        for i in range(0, len(texts), _TOKENIZE_CHUNK):
            enc = tok(texts[i : i + _TOKENIZE_CHUNK], add_special_tokens=add_special)["input_ids"]
            out.extend(np.asarray(ids, dtype=np.int32) for ids in enc)
        return out

    def _fit(self, where: str, ids: np.ndarray) -> np.ndarray | None:
        """Apply ``overlong_prompt``: the ids to keep, or None when the row is dropped."""
        limit = self._cfg.max_prompt_len
        if len(ids) <= limit:  # overlong_prompt: error has raised for every overlong row (_load_source)
            return ids
        if self._cfg.overlong_prompt == "drop":
            self.num_dropped += 1
            return None
        self.num_truncated += 1
        return ids[-limit:]


def content_hash(ids: np.ndarray, offsets: np.ndarray, index: np.ndarray, extra: bytes = b"") -> str:
    """A sha256 (16 hex digits) of a tokenized dataset's content in the order it serves it: the flat
    token ids, the offsets that cut them into items, the (blended) index, and ``extra`` bytes."""
    h = hashlib.sha256()
    for part in (ids, offsets, index):
        h.update(np.ascontiguousarray(part, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(extra)
    return h.hexdigest()[:16]


def blend_index(sources: Sequence[DataSource], per_source: list[np.ndarray], seed: int) -> np.ndarray:
    """The dataset's index list over kept rows, by the rule in the module docstring."""
    rng = np.random.default_rng(seed)
    parts = []
    for source, kept in zip(sources, per_source):
        count = int(round(source.weight * len(kept)))
        if count == 0:
            raise ValueError(
                f"{source.path}: contributes no prompts ({len(kept)} rows kept, weight {source.weight}); "
                f"raise its weight or check max_prompt_len / overlong_prompt"
            )
        full, rest = divmod(count, len(kept))
        parts.extend([kept] * full)
        if rest:
            parts.append(kept[np.sort(rng.choice(len(kept), size=rest, replace=False))])
    return np.concatenate(parts).astype(np.int64)
