"""The sequences being generated, as a structure of arrays: one row ("slot") per sequence.

A sequence takes a slot when it is added and keeps it until it finishes or is aborted, whether it
waits (new, prefilled in chunks, or preempted) or runs (decodes one token per step). Everything a
step reads or writes per sequence lives in per-slot numpy arrays of :class:`SequenceTable`, so the
scheduler and the model runner handle a batch of thousands of rows with a few array operations
instead of a Python loop; the :class:`Sequence` object holds only what never changes per step (the
request's ids, prompt, limits, images and resumed logprobs) and is touched on events (admission,
preemption, finish).

Per slot ``s`` (``N = num_tokens[s]``, ``P = num_prompt[s]``):
- ``tokens[s, :N]``: prompt, then every completion token (resumed ones first); ``logprobs[s, i]``
  is the sampling logprob of token ``i`` for the tokens sampled here (``i >= P + num_resumed``).
- ``max_len[s]``: the length at which it stops (prompt + max new tokens).
- KV of tokens ``[0, num_cached[s])`` is computed, or computed by a step already scheduled (and so
  before any later step reads it), in blocks ``block_table[s, :num_blocks[s]]``.
- A model with sliding-window layers (:mod:`~tidal.engine.native.window_blocks`): those layers'
  blocks in ``window_table[s, win_lo[s]:num_blocks[s]]`` (the columns before ``win_lo`` left the
  window and were given back).
- ``num_hashed[s]`` leading full blocks are in the prefix cache; ``last_hash[s]`` is the chain hash
  of the last of them (the sequence's ``cache_key`` seed when none).
- ``gen[s]`` counts the slot's owners: a batch scheduled ahead tells a live row from a row whose
  sequence finished meanwhile by comparing it.
- ``order[s]``: when it was last admitted to run (the most recent is preempted first).
- ``rng_seed[s]``, ``rng_key[s]``: the seed and key of its random stream; the token at index ``i``
  is drawn with :func:`tidal.engine.sampler.keyed_uniforms` of ``(rng_seed, rng_key, i)``.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tidal.engine.native.multimodal import MultimodalPrompt


class Status:
    """Values of ``SequenceTable.status`` (plain ints: numpy compares them without conversion)."""

    FREE = 0
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


# finish codes (``SequenceTable.finish``) and the reasons they stand for
FINISH_REASONS = {1: "stop", 2: "length", 3: "abort"}
STOP, LENGTH, ABORT = 1, 2, 3


class Sequence:
    """What a sequence's steps never change. ``old_logprobs``/``old_versions``: those of the resumed
    tokens (``num_resumed`` of them, right after the prompt). ``mm``: the prompt's images (shared by
    the sequences of one prompt, read-only here). ``seed``/``key``: its random stream (uint64 values;
    see ``rng_seed`` in the module docstring)."""

    __slots__ = ("seq_id", "request_id", "group_id", "prompt_ids", "slot", "stop_set", "mm",
                 "old_logprobs", "old_versions", "version", "seed", "key", "routed_experts")

    def __init__(self, seq_id: int, request_id, group_id, prompt_ids: list[int], *, stop_set: int,
                 mm: "MultimodalPrompt | None" = None, old_logprobs: list[float] | None = None,
                 old_versions: list[int] | None = None, version: int = 0, seed: int = 0, key: int = 0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.group_id = group_id
        self.prompt_ids = prompt_ids
        self.slot = -1
        self.stop_set = stop_set
        self.mm = mm
        self.old_logprobs = old_logprobs or []
        self.old_versions = old_versions or []
        self.version = version
        self.seed = seed
        self.key = key
        self.routed_experts: np.ndarray | None = None  # MoE: set when it finishes (NativeEngine._keep_routing)

    @property
    def num_resumed(self) -> int:
        return len(self.old_logprobs)

    @property
    def cache_key(self) -> int | None:
        return None if self.mm is None else self.mm.key

    @property
    def rope_delta(self) -> int:
        """Offset of generated tokens' RoPE positions from their index (M-RoPE prompts; else 0)."""
        return 0 if self.mm is None else self.mm.rope_delta


def _grow(a: np.ndarray, rows: int, cols: int | None = None, fill=0) -> np.ndarray:
    shape = (rows,) if a.ndim == 1 else (rows, cols)
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


class SequenceTable:
    """Per-slot arrays (see the module docstring), grown by doubling as sequences and lengths need.

    ``width``: columns of ``block_table`` (blocks per sequence), ``length``: columns of ``tokens``.
    """

    _ROW_FIELDS = {  # name -> dtype
        "status": np.int8, "finish": np.int8, "gen": np.int64, "num_tokens": np.int64, "num_prompt": np.int64,
        "max_len": np.int64, "num_cached": np.int64, "num_blocks": np.int64, "num_hashed": np.int64,
        "last_hash": np.uint64, "rope_delta": np.int64, "stop_set": np.int64, "order": np.int64,
        "rng_seed": np.uint64, "rng_key": np.uint64, "win_lo": np.int64,
    }

    def __init__(self, block_size: int, capacity: int = 64):
        self.block_size = block_size
        self.capacity = capacity
        for name, dt in self._ROW_FIELDS.items():
            setattr(self, name, np.zeros(capacity, dtype=dt))
        self.block_table = np.zeros((capacity, 8), dtype=np.int32)
        self.window_table = np.zeros((capacity, 8), dtype=np.int32)
        self.tokens = np.zeros((capacity, 64), dtype=np.int32)
        self.logprobs = np.zeros((capacity, 64), dtype=np.float32)
        self.seqs: list[Sequence | None] = [None] * capacity
        self._free = list(range(capacity))  # a heap: the lowest free slot first, so rows stay compact

    # ---- slots ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Slots in use (sequences added and not released)."""
        return self.capacity - len(self._free)

    def add(self, seq: Sequence, token_ids: list[int], max_len: int) -> int:
        """Give ``seq`` a slot holding ``token_ids`` (prompt + resumed tokens), waiting. Returns the slot."""
        if not self._free:
            self._grow_rows(2 * self.capacity)
        s = heapq.heappop(self._free)
        n = len(token_ids)
        self.reserve_length(n)
        self._reserve_blocks(-(-max_len // self.block_size))
        self.tokens[s, :n] = token_ids
        self.status[s], self.finish[s] = Status.WAITING, 0
        self.num_tokens[s], self.num_prompt[s], self.max_len[s] = n, len(seq.prompt_ids), max_len
        self.num_cached[s] = self.num_blocks[s] = self.num_hashed[s] = self.win_lo[s] = 0
        self.rope_delta[s], self.stop_set[s] = seq.rope_delta, seq.stop_set
        self.rng_seed[s], self.rng_key[s] = seq.seed, seq.key
        self.seqs[s] = seq
        seq.slot = s
        return s

    def release(self, slot: int) -> None:
        """Free ``slot`` (its blocks already given back); a batch still holding it sees a void row."""
        self.status[slot] = Status.FREE
        self.gen[slot] += 1
        self.seqs[slot] = None
        heapq.heappush(self._free, slot)

    def slots_with(self, status: int) -> np.ndarray:
        return np.flatnonzero(self.status == status)

    # ---- growth ---------------------------------------------------------------------------------
    def _grow_rows(self, rows: int) -> None:
        for name in self._ROW_FIELDS:
            setattr(self, name, _grow(getattr(self, name), rows))
        self.block_table = _grow(self.block_table, rows, self.block_table.shape[1])
        self.window_table = _grow(self.window_table, rows, self.window_table.shape[1])
        self.tokens = _grow(self.tokens, rows, self.tokens.shape[1])
        self.logprobs = _grow(self.logprobs, rows, self.logprobs.shape[1])
        self.seqs.extend([None] * (rows - self.capacity))
        self._free.extend(range(self.capacity, rows))  # all larger than any slot in the heap: still a heap
        self.capacity = rows

    def reserve_length(self, length: int) -> None:
        """Make ``tokens``/``logprobs`` hold ``length`` tokens per slot (grown as sequences grow, so
        the host memory follows the longest sequence so far, not the longest allowed)."""
        cols = self.tokens.shape[1]
        if length > cols:
            cols = max(length, 2 * cols)
            self.tokens = _grow(self.tokens, self.capacity, cols)
            self.logprobs = _grow(self.logprobs, self.capacity, cols)

    def _reserve_blocks(self, blocks: int) -> None:
        if blocks > self.block_table.shape[1]:
            cols = max(blocks, 2 * self.block_table.shape[1])
            self.block_table = _grow(self.block_table, self.capacity, cols)
            self.window_table = _grow(self.window_table, self.capacity, cols)

    # ---- reads for events -----------------------------------------------------------------------
    def token_list(self, slot: int, start: int = 0) -> list[int]:
        return self.tokens[slot, start : self.num_tokens[slot]].tolist()

    def blocks_of(self, slot: int) -> np.ndarray:
        return self.block_table[slot, : self.num_blocks[slot]]
