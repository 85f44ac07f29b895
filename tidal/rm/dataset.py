"""Preference-pair datasets: every source read (:mod:`tidal.data.loaders`), turned into two texts
per row (:mod:`tidal.rm.pairs`), tokenised once, then blended by weight exactly as prompt datasets
are (:func:`tidal.data.dataset.blend_index`: weight 1 uses each pair once per epoch, 2 twice, 0.5 a
fixed seeded half).

Tokenisation is :func:`tidal.rewards.model.encode_for_reward`, the reward component's own, so
training sees exactly the ids an RL run's reward model will score. Length: a pair whose longer
sequence exceeds ``reward_model.max_length`` is handled by ``reward_model.overlong``; bad rows by
``reward_model.bad_pairs`` (see :class:`~tidal.rm.config.RewardModelConfig`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Sequence

import numpy as np

from tidal.data.config import DataConfig, DataSource
from tidal.data.dataset import blend_index, content_hash
from tidal.data.loaders import load_rows
from tidal.data.prompts import require_chat_template
from tidal.rewards.model import encode_for_reward
from tidal.rm.config import RewardModelConfig
from tidal.rm.pairs import BadPair, PairTexts, pair_texts

_TOKENIZE_CHUNK = 1024


@dataclasses.dataclass(kw_only=True, frozen=True)
class Pair:
    """One preference pair as the trainer sees it: the token ids of its two scored sequences and
    where the row came from (``file.jsonl:12`` or ``file.parquet row 3``)."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    where: str

    @property
    def length(self) -> int:
        """Tokens of the longer sequence (what a micro-batch pads both to at least)."""
        return max(len(self.chosen_ids), len(self.rejected_ids))


class PreferenceDataset:
    """All pairs of ``sources`` under ``data`` / ``rm`` settings; see the module docstring.

    Counters: ``num_pairs`` distinct pairs kept, ``skipped`` (kind -> rows left out by
    ``bad_pairs: skip``: ``malformed`` / ``identical``), ``num_dropped`` (``overlong: drop``),
    ``num_truncated`` (``overlong: left_truncate``). Raises ValueError naming the file and line
    for a bad row under ``bad_pairs: error`` or an overlong pair under ``overlong: error``.
    """

    def __init__(self, sources: Sequence[DataSource], tokenizer: Any, data: DataConfig, rm: RewardModelConfig, *, seed: int):
        if not sources:
            raise ValueError("no preference-pair sources given (set data.train / data.eval)")
        require_chat_template(tokenizer, data)
        self._tokenizer, self._data, self._rm = tokenizer, data, rm
        self.skipped: Counter[str] = Counter()
        self.first_skip: dict[str, str] = {}
        self.num_dropped = 0
        self.num_truncated = 0
        self._where: list[str] = []
        self._seqs: list[np.ndarray] = []  # chosen and rejected ids of pair k at 2k and 2k + 1
        per_source = []
        for source in sources:
            start = self.num_pairs
            self._load_source(source)
            if self.num_pairs == start:
                raise ValueError(f"{source.path}: no usable preference pairs ({self.summary()})")
            per_source.append(np.arange(start, self.num_pairs))
        # one flat int32 buffer (a Python list per sequence would cost ~10x the memory)
        self._offsets = np.concatenate([[0], np.cumsum([len(s) for s in self._seqs])]).astype(np.int64)
        self._ids = np.concatenate(self._seqs) if self._seqs else np.zeros(0, np.int32)
        del self._seqs
        self._index = blend_index(sources, per_source, seed)

    @property
    def num_pairs(self) -> int:
        return len(self._where)

    @property
    def content_hash(self) -> str:
        """Every pair's token ids in the order served (:func:`~tidal.data.dataset.content_hash`)."""
        return content_hash(self._ids, self._offsets, self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> Pair:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair index {i} out of range for {len(self)} pairs")
        k = int(self._index[i])
        o = self._offsets
        return Pair(
            chosen_ids=self._ids[o[2 * k] : o[2 * k + 1]].tolist(),
            rejected_ids=self._ids[o[2 * k + 1] : o[2 * k + 2]].tolist(),
            where=self._where[k],
        )

    def summary(self) -> str:
        """Counts of kept and left-out pairs, with the first reason of each kind of skip."""
        parts = [f"{self.num_pairs} pairs kept"]
        parts += [f"{n} skipped as {kind} (first: {self.first_skip[kind]})" for kind, n in sorted(self.skipped.items())]
        if self.num_dropped:
            parts.append(f"{self.num_dropped} overlong dropped")
        if self.num_truncated:
            parts.append(f"{self.num_truncated} left-truncated")
        return "; ".join(parts)

    def _load_source(self, source: DataSource) -> None:
        texts: list[tuple[str, PairTexts]] = []
        for where, row in load_rows(source):
            try:
                texts.append((where, pair_texts(where, row, self._data, self._rm, self._tokenizer)))
            except BadPair as e:
                self._bad(e)
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            chunk = texts[start : start + _TOKENIZE_CHUNK]
            flat = [t for _, p in chunk for t in (p.chosen, p.rejected)]
            ids = encode_for_reward(self._tokenizer, flat, max_length=None)
            for k, (where, p) in enumerate(chunk):
                self._add(where, p, ids[2 * k], ids[2 * k + 1])

    def _bad(self, e: BadPair) -> None:
        if self._rm.bad_pairs == "error":
            raise ValueError(f"{e} (reward_model.bad_pairs=skip leaves such rows out)") from None
        self.skipped[e.kind] += 1
        self.first_skip.setdefault(e.kind, str(e))

    def _add(self, where: str, texts: PairTexts, chosen: list[int], rejected: list[int]) -> None:
        limit = self._rm.max_length
        if max(len(chosen), len(rejected)) > limit:
            if self._rm.overlong == "error":
                raise ValueError(
                    f"{where}: a sequence of this pair has {max(len(chosen), len(rejected))} tokens > "
                    f"reward_model.max_length={limit} (set reward_model.overlong to drop or left_truncate)"
                )
            if self._rm.overlong == "drop":
                self.num_dropped += 1
                return
            self.num_truncated += 1
            chosen, rejected = encode_for_reward(self._tokenizer, [texts.chosen, texts.rejected], max_length=limit)
        if chosen == rejected:  # two replies that differ only in what truncation cut
            return self._bad(BadPair(f"{where}: chosen and rejected are the same tokens after truncation to {limit}", kind="identical"))
        self._where.append(where)
        self._seqs += [np.asarray(chosen, dtype=np.int32), np.asarray(rejected, dtype=np.int32)]
