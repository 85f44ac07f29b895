"""The KV blocks of sliding-window layers: a pool of their own, whose blocks leave a sequence as
its window slides past them.

A model with both full-attention and sliding-window layers keeps two block pools (the design of
SGLang's SWA pool; vLLM's hybrid allocator shares one pool between kinds instead): the full layers'
blocks (:class:`~tidal.engine.native.block_manager.BlockManager` of the scheduler, every token of a
sequence) and the window layers' (:class:`WindowBlocks`, another ``BlockManager``). Both index a
sequence's token ``p`` by its logical block ``p // block_size``: column ``j`` of the table's
``block_table`` is the full layers' block of positions ``[j * bs, (j + 1) * bs)``, column ``j`` of
``window_table`` the window layers' block of the same positions. The window layers' blocks a
sequence holds are the columns ``[win_lo, num_blocks)``; columns before ``win_lo`` left the window
and were given back (their entry is 0, never read).

When the window layers' pool is ``window`` tokens wide (the largest window of the model's window
layers), a query at position ``q`` reads keys ``q - window < j <= q`` only: the step that computes
positions from ``q0`` on needs the columns from ``(q0 - window + 1) // bs`` on, and the columns
before it are given back when that step is scheduled (:meth:`WindowBlocks.slide`). That is safe
although earlier steps may still be in flight: steps run in order on the device, so a block given
back now is written by another sequence only in this step or a later one, none of which reads it
for this sequence. A decoding sequence therefore holds at most ``(window - 1) // bs + 2`` window
blocks; a prefill holds the blocks of all its new tokens for one step.

Prefix caching: a window block is registered under the same chain hash as the full block of its
column, and kept (hash and content) once given back until the pool reallocates it. A cached prefix
of ``k`` full blocks is usable for a new sequence only if the window blocks of its last window
(columns ``(k * bs - window + 1) // bs .. k - 1``) are still cached too: :meth:`lookup` returns
the longest such ``k``.

Everything here is bookkeeping on numpy arrays: identical inputs give identical decisions on every
TP rank.
"""

from __future__ import annotations

import numpy as np

from tidal.engine.native.block_manager import BlockManager
from tidal.engine.native.sequence import SequenceTable


class WindowBlocks:
    """The window layers' blocks of the sequences in ``table`` (``window_table``, ``win_lo``),
    from a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, table: SequenceTable, num_blocks: int, block_size: int, window: int, prefix_caching: bool):
        if window < 1:
            raise ValueError(f"window {window}: must be >= 1")
        self.table = table
        self.window = window
        self.block_size = block_size
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)

    @property
    def num_blocks(self) -> int:
        return self.bm.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.bm.num_free_blocks

    def first_column(self, q0) -> np.ndarray | int:
        """The first column a query at position ``q0`` (int or array) reads."""
        return np.maximum(0, q0 - self.window + 1) // self.block_size

    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    # ---- admission ------------------------------------------------------------------------------
    def lookup(self, hashes: list[int], tokens: np.ndarray) -> tuple[int, list[int]]:
        """For a new sequence whose first ``len(hashes)`` full blocks are cached (chain ``hashes``,
        its ``tokens``): the longest ``k <= len(hashes)`` whose last window's blocks are cached in
        this pool too, and those blocks (columns ``first_column(k * bs) .. k - 1``)."""
        bs = self.block_size
        for k in range(len(hashes), 0, -1):
            lo = int(self.first_column(k * bs))
            bids = [self.bm.hash_to_block.get(h) for h in hashes[lo:k]]
            if any(b is None for b in bids):
                continue
            want = tokens[lo * bs : k * bs].reshape(k - lo, bs)
            if (self.bm.block_tokens[bids] == want).all():
                return k, bids
        return 0, []

    def can_admit(self, need: int, k: int, hits: list[int]) -> bool:
        """Whether a sequence of ``need`` columns, ``k`` of them cached (``hits``: the window blocks
        of the last window of them), gets its window blocks now."""
        lo = int(self.first_column(k * self.block_size)) if k else 0
        return self.bm.can_allocate(need - lo, hits)

    def admit(self, s: int, need: int, k: int, hits: list[int]) -> None:
        """Give the sequence in slot ``s`` its window blocks for columns ``[lo, need)``: the cached
        ``hits`` for ``[lo, k)``, fresh ones after (``lo``: the first column its first computed
        position ``k * bs`` reads)."""
        lo = int(self.first_column(k * self.block_size)) if k else 0
        t = self.table
        t.window_table[s, :lo] = 0
        t.window_table[s, lo:need] = self.bm.allocate(need - lo, hits)
        t.win_lo[s] = lo

    # ---- steps ----------------------------------------------------------------------------------
    def slide(self, slots: np.ndarray, q0: np.ndarray) -> None:
        """Give back the window blocks of ``slots`` that the step being scheduled (its first query
        of each slot at position ``q0``) and every later one no longer read."""
        t = self.table
        lo = np.minimum(self.first_column(q0), t.num_blocks[slots])
        moved = lo > t.win_lo[slots]
        if not moved.any():
            return
        slots, lo, old = slots[moved], lo[moved], t.win_lo[slots[moved]]
        n = lo - old
        r = np.repeat(np.arange(len(slots)), n)
        col = np.repeat(old, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        self.bm.release(t.window_table[slots[r], col].copy())
        t.window_table[slots[r], col] = 0
        t.win_lo[slots] = lo

    def append(self, slots: np.ndarray) -> None:
        """One fresh block for each of ``slots`` at column ``num_blocks`` (before it is counted)."""
        if len(slots):
            self.table.window_table[slots, self.table.num_blocks[slots]] = self.bm.take(len(slots))

    def place(self, rows: np.ndarray, cols: np.ndarray) -> None:
        """Fresh blocks at columns ``cols`` of slots ``rows`` (a verify step's drafted positions)."""
        if len(rows):
            self.table.window_table[rows, cols] = self.bm.take(len(rows))

    def register(self, slots: np.ndarray, cols: np.ndarray, hashes, tokens_KB: np.ndarray) -> None:
        """Register the window blocks at ``cols`` of ``slots`` (one each, full and held) under
        ``hashes``, as their full blocks are; columns already given back are skipped."""
        held = cols >= self.table.win_lo[slots]
        if held.any():
            self.bm.register(self.table.window_table[slots[held], cols[held]], np.asarray(hashes, dtype=np.uint64)[held],
                             tokens_KB[held])

    def trim(self, s: int, keep: int) -> None:
        """Give back the window blocks of slot ``s`` at columns ``>= keep`` (up to ``num_blocks``)."""
        t = self.table
        lo, hi = max(keep, int(t.win_lo[s])), int(t.num_blocks[s])
        if hi > lo:
            self.bm.release(t.window_table[s, lo:hi][::-1].copy())
            t.window_table[s, lo:hi] = 0

    def held(self, s: int) -> np.ndarray:
        """The window blocks slot ``s`` holds, last column first (the order they are given back)."""
        t = self.table
        return t.window_table[s, int(t.win_lo[s]) : int(t.num_blocks[s])][::-1]

    def release(self, slots: np.ndarray) -> None:
        """Give back every window block of ``slots`` (each one's last column first)."""
        held = [self.held(s) for s in slots.tolist()]
        held = [h for h in held if len(h)]
        if held:
            self.bm.release(np.concatenate(held))
        for s in slots.tolist():
            self.table.window_table[s, : self.table.num_blocks[s]] = 0
        self.table.win_lo[slots] = 0
