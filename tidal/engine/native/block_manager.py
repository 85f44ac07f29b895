"""KV-cache blocks: allocation, reference counts and prefix caching by chained block hashes.

A full block is identified by the chain hash of (hash of the previous block, its token ids); the
first block's "previous hash" is the sequence's seed (0 for text, a hash of its images for an image
prompt). When a new sequence starts, its leading full blocks are looked up by that chain: a hit
reuses the block (reference count + 1) instead of recomputing it, which is how the n samples of one
prompt (and any shared prefix, e.g. the earlier turns of a conversation) are prefilled once. A
block is registered under its hash as soon as its KV is scheduled to be computed (prefill) or has
been computed (decode), so later sequences can share it (in the same step too: every layer writes
all new K/V before any attention reads the cache). A hit also compares the block's token ids, so a
hash collision costs a recomputation, never a wrong cache entry for that block.

Freed blocks keep their hash and content until reallocated (least recently freed first), so a
prefix can still hit after its sequences finished. :meth:`reset_prefix_cache` forgets all hashes
(the weights changed, or the KV memory was released).

The hashes are 64-bit and computed with numpy over whole batches of blocks (:func:`block_digests`,
:func:`chain_hashes`); :func:`chain_one` is the same chain step on Python ints, for walking one
sequence's blocks in order. The manager is pure bookkeeping: identical inputs give identical
decisions on every TP rank.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


def _powers(n: int) -> np.ndarray:
    """``P**1 .. P**n`` mod 2**64 for the odd constant P."""
    out, x = [], 1
    for _ in range(n):
        x = (x * _POLY) & _MASK
        out.append(x)
    return np.array(out, dtype=np.uint64)


_POLY = 0x100000001B3
_POWERS = {}


def block_digests(tokens_KB: np.ndarray) -> np.ndarray:
    """A polynomial digest of each row's token ids (mod 2**64): ``uint64 [K]`` for ``tokens_KB
    [K, block_size]``; :func:`chain_hashes` mixes it with the previous block's hash."""
    B = tokens_KB.shape[1]
    if B not in _POWERS:
        _POWERS[B] = _powers(B)
    return (tokens_KB.astype(np.uint64) * _POWERS[B]).sum(axis=1, dtype=np.uint64)


def chain_hashes(prev_K: np.ndarray, digest_K: np.ndarray) -> np.ndarray:
    """The block hash after ``prev_K`` for a block of digest ``digest_K`` (MurmurHash3's finaliser
    over the mix of both), elementwise, ``uint64``."""
    x = (prev_K.astype(np.uint64) * np.uint64(_GOLDEN)) ^ digest_K
    x ^= x >> np.uint64(33)
    x *= np.uint64(_M1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_M2)
    return x ^ (x >> np.uint64(33))


def chain_one(prev: int, digest: int) -> int:
    """:func:`chain_hashes` for one block, on Python ints."""
    x = ((prev * _GOLDEN) & _MASK) ^ digest
    x ^= x >> 33
    x = (x * _M1) & _MASK
    x ^= x >> 33
    x = (x * _M2) & _MASK
    return x ^ (x >> 33)


def prefix_hashes(blocks_KB: np.ndarray, prev: int) -> list[int]:
    """The chain hashes of consecutive full blocks ``blocks_KB`` following a block of hash ``prev``."""
    out = []
    for digest in block_digests(blocks_KB).tolist():
        prev = chain_one(prev, digest)
        out.append(prev)
    return out


def seed_of(cache_key: int | None) -> int:
    """The chain's starting "previous hash" for a sequence with ``cache_key`` (None: text)."""
    return 0 if cache_key is None else cache_key & _MASK


class FreeQueue:
    """The free blocks in the order they were freed (the least recently freed are taken first), as
    numpy arrays: a queue of (block, stamp) entries with lazy removal. A block taken out of order (a
    prefix hit on a free block) only loses its ``is_free`` flag; a queue entry counts only while its
    block is free under the same stamp. Taking or freeing thousands of blocks is a few array ops."""

    def __init__(self, num_blocks: int):
        self.is_free = np.ones(num_blocks, dtype=bool)
        self.stamp = np.zeros(num_blocks, dtype=np.int64)
        self._bid = np.arange(num_blocks, dtype=np.int32)
        self._bstamp = np.zeros(num_blocks, dtype=np.int64)
        self._head = 0
        self._tail = num_blocks
        self._clock = 1
        self.count = num_blocks

    def __len__(self) -> int:
        return self.count

    def push(self, bids: np.ndarray) -> None:
        """Free ``bids`` (distinct, none free), in this order."""
        k = len(bids)
        if self._tail + k > len(self._bid):
            self._compact(k)
        stamps = np.arange(self._clock, self._clock + k, dtype=np.int64)
        self._clock += k
        self.stamp[bids] = stamps
        self.is_free[bids] = True
        self._bid[self._tail : self._tail + k] = bids
        self._bstamp[self._tail : self._tail + k] = stamps
        self._tail += k
        self.count += k

    def remove(self, bid: int) -> None:
        """Take the free block ``bid`` out of order."""
        self.is_free[bid] = False
        self.count -= 1

    def pop(self, k: int) -> np.ndarray:
        """The ``k`` least recently freed blocks (``k <= len(self)``)."""
        if k <= 8:  # a new sequence's few blocks: cheaper entry by entry than as array ops
            return self._pop_few(k)
        out, window = [], max(2 * k, 64)
        while k:
            lo, hi = self._head, min(self._tail, self._head + window)
            bids = self._bid[lo:hi]
            valid = np.flatnonzero(self.is_free[bids] & (self.stamp[bids] == self._bstamp[lo:hi]))[:k]
            taken = bids[valid]
            out.append(taken)
            k -= len(taken)
            self._head = lo + int(valid[-1]) + 1 if k == 0 else hi
            window *= 2
        taken = np.concatenate(out) if len(out) > 1 else out[0]
        self.is_free[taken] = False
        self.count -= len(taken)
        return taken

    def _pop_few(self, k: int) -> np.ndarray:
        out = np.empty(k, dtype=np.int32)
        head, got = self._head, 0
        bid_q, stamp_q, is_free, stamp = self._bid, self._bstamp, self.is_free, self.stamp
        while got < k:
            bid = bid_q[head]
            if is_free[bid] and stamp[bid] == stamp_q[head]:
                out[got] = bid
                is_free[bid] = False
                got += 1
            head += 1
        self._head = head
        self.count -= k
        return out

    def _compact(self, extra: int) -> None:
        lo, hi = self._head, self._tail
        bids, stamps = self._bid[lo:hi], self._bstamp[lo:hi]
        keep = self.is_free[bids] & (self.stamp[bids] == stamps)
        bids, stamps = bids[keep], stamps[keep]
        size = max(len(self._bid), 2 * (len(bids) + extra))
        self._bid = np.zeros(size, dtype=np.int32)
        self._bstamp = np.zeros(size, dtype=np.int64)
        self._bid[: len(bids)], self._bstamp[: len(bids)] = bids, stamps
        self._head, self._tail = 0, len(bids)


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots.

    Counters: ``num_hit_tokens`` (prompt tokens served from the cache instead of recomputed).
    ``prefix_caching=False`` turns hashing off: every sequence computes all its tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self.hashed = np.zeros(num_blocks, dtype=bool)
        self.hash_of = np.zeros(num_blocks, dtype=np.uint64)
        self.block_tokens = np.zeros((num_blocks if prefix_caching else 0, block_size), dtype=np.int32)
        self.free = FreeQueue(num_blocks)
        self.hash_to_block: dict[int, int] = {}
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def reset_prefix_cache(self) -> None:
        if len(self.free) != self.num_blocks:
            raise RuntimeError("cannot reset the prefix cache while sequences hold blocks")
        self.hash_to_block.clear()
        self.hashed[:] = False

    # ---- prefix lookup --------------------------------------------------------------------------
    def lookup(self, tokens: np.ndarray, seed: int) -> tuple[list[int], list[int]]:
        """(hashes, block ids) of the cached leading full blocks of a sequence of ``tokens``; the
        block holding the last token is never taken from the cache (its logits must be computed)."""
        full = (len(tokens) - 1) // self.block_size if self.prefix_caching else 0
        if full <= 0 or not self.hash_to_block:
            return [], []
        blocks_KB = tokens[: full * self.block_size].reshape(full, self.block_size)
        hashes, bids, prev = [], [], seed
        for digest in block_digests(blocks_KB).tolist():
            prev = chain_one(prev, digest)
            bid = self.hash_to_block.get(prev)
            if bid is None:
                break
            hashes.append(prev)
            bids.append(bid)
        if bids:  # a hit must hold the same tokens (a hash collision is a miss)
            same = (self.block_tokens[bids] == blocks_KB[: len(bids)]).all(axis=1)
            if not same.all():
                k = int(np.argmin(same))
                hashes, bids = hashes[:k], bids[:k]
        return hashes, bids

    # ---- allocation -----------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int, hits: list[int]) -> bool:
        """Whether a sequence of ``num_blocks`` blocks, ``hits`` of them cached, fits now."""
        held = int(np.count_nonzero(self.ref_count[hits])) if hits else 0
        return self.num_free_blocks >= num_blocks - held

    def allocate(self, num_blocks: int, hits: list[int]) -> np.ndarray:
        """``num_blocks`` block ids for a new sequence: the cached prefix ``hits`` shared, fresh
        blocks for the rest."""
        for bid in hits:
            if self.ref_count[bid] == 0:
                self.free.remove(bid)
            self.ref_count[bid] += 1
        self.num_hit_tokens += len(hits) * self.block_size
        fresh = self.take(num_blocks - len(hits))
        return np.concatenate([np.asarray(hits, dtype=np.int32), fresh]) if hits else fresh

    def take(self, k: int) -> np.ndarray:
        """``k`` fresh blocks (the least recently freed), their cached content forgotten."""
        if k > len(self.free):
            raise RuntimeError(f"take({k}) with {len(self.free)} free blocks")
        out = self.free.pop(k) if k else np.zeros(0, dtype=np.int32)
        stale = out[self.hashed[out]]
        for bid, h in zip(stale.tolist(), self.hash_of[stale].tolist()):
            if self.hash_to_block.get(h) == bid:
                del self.hash_to_block[h]
        self.hashed[out] = False
        self.ref_count[out] = 1
        return out

    def release(self, bids: np.ndarray) -> None:
        """Drop one reference to each of ``bids``; blocks nobody holds return to the free list (their
        content kept) in the order their last reference went."""
        if not len(bids):
            return
        np.subtract.at(self.ref_count, bids, 1)
        gone = bids[self.ref_count[bids] == 0]
        if len(np.unique(gone)) != len(gone):  # a block released twice here: freed at its last release
            _, last = np.unique(gone[::-1], return_index=True)
            gone = gone[np.sort(len(gone) - 1 - last)]
        self.free.push(gone)

    # ---- prefix registration --------------------------------------------------------------------
    def register(self, bids: np.ndarray, hashes: np.ndarray | list[int], tokens_KB: np.ndarray) -> None:
        """Make full blocks ``bids`` (token ids ``tokens_KB``) findable under ``hashes``."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        self.hash_of[bids] = hashes
        self.hashed[bids] = True
        self.block_tokens[bids] = tokens_KB
        self.hash_to_block.update(zip(hashes.tolist(), bids.tolist()))
