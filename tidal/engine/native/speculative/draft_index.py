"""Model-free drafts: an n-gram index over the text a sequence's relatives already wrote.

A sequence's draft continues its last ``n`` tokens (``n`` in :data:`NGRAM_SIZES`, the longest that
matches first) with what followed their most recent occurrence in:

- its own prompt and tokens so far,
- the other sequences of its prompt: GRPO siblings in flight, and the responses this prompt got
  earlier (an earlier epoch, an earlier iteration of a partial rollout), while they are still held,
- the sequences of its group whose prompts differ (a multi-turn group's later turns).

Texts are kept per prompt (a :class:`NgramStore`, keyed by the prompt's token ids): one entry per
``(n, n-gram)`` pointing at the position after its most recent occurrence, so a lookup is a few dict
reads. Text is copied in as sequences grow and finish, and indexed only when a lookup consults its
store: a rollout that never drafts (``auto`` with many sequences running) pays a copy per sequence. Stores are kept in least-recently-used order and evicted whole (oldest first, never one a
live sequence writes to) once they hold more than ``max_tokens`` tokens in all: memory is bounded
and old prompts are forgotten by age. The index only proposes; correctness never depends on it
(:mod:`.acceptance`), so a hash collision costs a rejected draft (and lookups compare the n-gram's
tokens, so it does not even cost that). Identical inputs give identical drafts on every TP rank.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

NGRAM_SIZES = (4, 3, 2)  # tried longest first
MAX_INDEXED_TOKENS = 1 << 19  # default bound on the tokens held over all stores (~170 MB of dicts)
_P = np.uint64(0x100000001B3)
_POW = {n: np.array([int(_P) ** (n - 1 - j) % (1 << 64) for j in range(n)], dtype=np.uint64) for n in NGRAM_SIZES}


_P_PY = int(_P)
_MASK = (1 << 64) - 1
_FEW = 16  # continuation positions below which ingestion runs on Python ints (numpy's per-call cost dominates)


def ngram_hashes(windows_WN: np.ndarray) -> np.ndarray:
    """A polynomial hash (mod 2**64) of each row of ``windows_WN`` (token ids), ``uint64 [W]``."""
    n = windows_WN.shape[1]
    return (windows_WN.astype(np.uint64) * _POW[n]).sum(axis=1, dtype=np.uint64)


def ngram_hash(tokens: list[int]) -> int:
    """:func:`ngram_hashes` of one n-gram, on Python ints (Horner's rule)."""
    h = 0
    for t in tokens:
        h = h * _P_PY + t
    return h & _MASK


class _Doc:
    """One sequence's tokens (prompt first), grown by doubling; ``indexed``: the continuation
    positions ``< indexed`` are in its store's maps."""

    __slots__ = ("tokens", "length", "indexed", "live")

    def __init__(self, start_indexed: int):
        self.tokens = np.zeros(64, dtype=np.int32)
        self.length = 0
        self.indexed = start_indexed
        self.live = True

    def extend_to(self, row: np.ndarray) -> None:
        """Make the doc hold ``row`` (which extends what it holds)."""
        n = len(row)
        if n > len(self.tokens):
            grown = np.zeros(max(n, 2 * len(self.tokens)), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : n] = row[self.length :]
        self.length = n


class NgramStore:
    """The texts of one prompt's sequences and, per n-gram size, ``hash -> doc << 32 | position``
    of the token after the n-gram's most recent occurrence."""

    def __init__(self):
        self.docs: list[_Doc] = []
        self.maps: dict[int, dict[int, int]] = {n: {} for n in NGRAM_SIZES}
        self.num_tokens = 0
        self.prompt_indexed = False  # the shared prompt is in the maps (siblings skip it)
        self.pending: set[int] = set()  # docs holding tokens not yet in the maps

    @property
    def live(self) -> bool:
        return any(d.live for d in self.docs)

    def new_doc(self, prompt_len: int) -> int:
        start = max(prompt_len, 1) if self.prompt_indexed else 1
        self.prompt_indexed = True
        self.docs.append(_Doc(start))
        return len(self.docs) - 1

    def extend(self, doc_id: int, row: np.ndarray) -> int:
        """Make doc ``doc_id`` hold ``row`` (its whole text so far), indexed at the next lookup.
        Returns the tokens added."""
        doc = self.docs[doc_id]
        added = len(row) - doc.length
        doc.extend_to(row)
        self.num_tokens += added
        if doc.indexed < doc.length:
            self.pending.add(doc_id)
        return added

    def index_pending(self) -> None:
        """Index what the docs received since the last lookup (older docs first: a later doc's
        occurrence of an n-gram wins). Indexing waits for a lookup, so text that is never drafted
        from (a rollout that does not speculate) costs a copy, not an index."""
        for doc_id in sorted(self.pending):
            self._index(doc_id)
        self.pending.clear()

    def _index(self, doc_id: int) -> None:
        """Index the continuation positions of doc ``doc_id`` not yet indexed."""
        doc = self.docs[doc_id]
        lo, hi = doc.indexed, doc.length
        toks = doc.tokens
        if 0 < hi - lo <= _FEW:
            recent = toks[max(0, lo - max(NGRAM_SIZES)) : hi].tolist()
            off = max(0, lo - max(NGRAM_SIZES))
            for p in range(lo, hi):
                for n in NGRAM_SIZES:
                    if p >= n:
                        self.maps[n][ngram_hash(recent[p - n - off : p - off])] = (doc_id << 32) | p
            doc.indexed = hi
            return
        for n in NGRAM_SIZES:
            a = max(lo, n)
            if hi - a <= 0:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(toks[a - n : hi - 1], n)
            pos = np.arange(a, hi, dtype=np.int64) | (doc_id << 32)
            self.maps[n].update(zip(ngram_hashes(windows).tolist(), pos.tolist()))
        doc.indexed = max(lo, hi)

    def continuation(self, tail: np.ndarray, n: int, key: int, k: int) -> np.ndarray | None:
        """Up to ``k`` tokens after the most recent occurrence of ``tail[-n:]`` (hash ``key``), or None."""
        hit = self.maps[n].get(key)
        if hit is None:
            return None
        doc, p = self.docs[hit >> 32], hit & 0xFFFFFFFF
        if not np.array_equal(doc.tokens[p - n : p], tail[-n:]):
            return None
        return doc.tokens[p : min(p + k, doc.length)]


@dataclasses.dataclass
class _Entry:
    store_key: tuple
    doc_id: int
    group_id: object


class DraftIndex:
    """Draft sources of the sequences in flight (see the module docstring). ``add`` a sequence when
    it is queued, ``update`` it with its tokens before asking for a draft, ``finish`` it with its
    final tokens; ``propose`` returns a draft."""

    def __init__(self, max_tokens: int = MAX_INDEXED_TOKENS, max_groups: int = 1 << 14):
        self.max_tokens = max_tokens
        self.max_groups = max_groups
        self.stores: OrderedDict[tuple, NgramStore] = OrderedDict()
        self.groups: OrderedDict[object, list[tuple]] = OrderedDict()  # group id -> its prompts' store keys
        self.entries: dict[int, _Entry] = {}  # seq id -> where its text is
        self.num_tokens = 0

    def add(self, seq_id: int, prompt_ids, group_id) -> None:
        key = (len(prompt_ids), hash(tuple(prompt_ids)))
        store = self.stores.get(key)
        if store is None:
            store = self.stores[key] = NgramStore()
        self.stores.move_to_end(key)
        self.entries[seq_id] = _Entry(key, store.new_doc(len(prompt_ids)), group_id)
        if group_id is not None:
            keys = self.groups.setdefault(group_id, [])
            if key not in keys:
                keys.append(key)
            self.groups.move_to_end(group_id)
            while len(self.groups) > self.max_groups:
                self.groups.popitem(last=False)

    def update(self, seq_id: int, row: np.ndarray) -> None:
        """Take sequence ``seq_id``'s text ``row`` (prompt + tokens so far; it only grows)."""
        e = self.entries[seq_id]
        self.num_tokens += self.stores[e.store_key].extend(e.doc_id, row)

    def finish(self, seq_id: int, row: np.ndarray) -> None:
        """Take the final text of ``seq_id`` and keep it for its prompt's later sequences."""
        self.update(seq_id, row)
        e = self.entries.pop(seq_id)
        self.stores[e.store_key].docs[e.doc_id].live = False
        self._evict()

    def propose(self, seq_id: int, row: np.ndarray, k: int) -> np.ndarray | None:
        """Up to ``k`` drafted tokens after ``row`` (the sequence's text, already taken by
        :meth:`update`), or None. Indexes the consulted stores' pending text first."""
        e = self.entries[seq_id]
        keys = [e.store_key]
        if e.group_id is not None:
            keys += [key for key in self.groups.get(e.group_id, ()) if key != e.store_key and key in self.stores]
        stores = [self.stores[key] for key in keys]
        for store in stores:
            store.index_pending()
        tail = row[-max(NGRAM_SIZES):]
        tail_list = tail.tolist()
        for n in NGRAM_SIZES:
            if len(tail) < n:
                continue
            h = ngram_hash(tail_list[-n:])
            for store in stores:
                draft = store.continuation(tail, n, h, k)
                if draft is not None and len(draft):
                    return draft
        return None

    def _evict(self) -> None:
        """Drop the least recently used stores no live sequence writes to while over the budget."""
        if self.num_tokens <= self.max_tokens:
            return
        for key in list(self.stores):
            store = self.stores[key]
            if store.live:
                continue
            del self.stores[key]
            self.num_tokens -= store.num_tokens
            if self.num_tokens <= self.max_tokens:
                break
