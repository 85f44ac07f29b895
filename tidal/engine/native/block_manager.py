"""KV-cache blocks: allocation, reference counts and prefix caching by block hashes.

A full block is identified by the hash of (hash of the previous block, its token ids); the first
block's "previous hash" is the sequence's ``cache_key`` (its images, for an image prompt). When a new
sequence starts, its leading full blocks are looked up by that chain: a hit reuses the block
(reference count + 1) instead of recomputing it, which is how the n samples of one prompt (and any
shared prefix) are prefilled once. A block is registered under its hash as soon as its KV is
scheduled to be computed, so later sequences in the same step can already share it (every layer
writes all new K/V before any attention reads the cache).

Freed blocks keep their hash and content until reallocated (least recently freed first), so a
prefix can still hit after its sequences finished. :meth:`reset_prefix_cache` forgets all hashes
(the weights changed, or the KV memory was released).

The manager is pure bookkeeping: identical inputs give identical decisions on every TP rank.
"""

from __future__ import annotations

from collections import OrderedDict

from tidal.engine.native.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def block_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash; deterministic across processes (hash of a tuple of ints is not salted)."""
    return hash((prev, token_ids))


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots.

    Counters: ``num_hit_tokens`` (prompt tokens served from the cache instead of recomputed).
    ``prefix_caching=False`` turns hashing off: every sequence computes all its tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def reset_prefix_cache(self) -> None:
        if len(self.free) != len(self.blocks):
            raise RuntimeError("cannot reset the prefix cache while sequences hold blocks")
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()

    def _lookup(self, seq: Sequence) -> list[tuple[int, int]]:
        """(hash, block id) of the cached leading full blocks of ``seq``; the block holding the last
        token is never taken from the cache (its logits must be computed)."""
        hits, prev = [], seq.cache_key
        for i in range((len(seq) - 1) // self.block_size if self.prefix_caching else 0):
            tokens = tuple(seq.block(i, self.block_size))
            h = block_hash(prev, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            hits.append((h, bid))
            prev = h
        return hits

    def can_allocate(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """The prefix hits to pass to :meth:`allocate`, or None when too few blocks are free."""
        hits = self._lookup(seq)
        held = sum(1 for _, bid in hits if self.blocks[bid].ref_count > 0)
        return hits if self.num_free_blocks >= seq.num_blocks(self.block_size) - held else None

    def allocate(self, seq: Sequence, hits: list[tuple[int, int]]) -> None:
        """Give ``seq`` its blocks: the cached prefix ``hits`` shared, fresh blocks for the rest."""
        assert not seq.block_table
        for h, bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
        for _ in range(len(hits), seq.num_blocks(self.block_size)):
            seq.block_table.append(self._take_free())
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_hit_tokens += seq.num_cached_tokens

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return bid

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds return to the free list (content kept)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step of ``seq`` (KV for its last token) has a slot."""
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Make room for KV of ``num_tokens`` tokens (default ``len(seq)``): at most one new block."""
        if (len(seq) if num_tokens is None else num_tokens) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free())

    def register_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (their KV is computed
        in the step being scheduled) so other sequences can share them."""
        if not self.prefix_caching:
            return
        prev = seq.block_hashes[-1] if seq.block_hashes else seq.cache_key
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            tokens = tuple(seq.block(i, self.block_size))
            h = block_hash(prev, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tokens
            self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)
            prev = h
