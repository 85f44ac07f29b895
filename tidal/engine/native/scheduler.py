"""Continuous batching: which sequences run in the next step, and what happens after it.

Policy (the nano-vllm shape):
- Prefill first: waiting sequences are admitted in order while their blocks fit, up to
  ``max_num_seqs`` running sequences (None: as many as the KV cache holds) and
  ``max_num_batched_tokens`` new tokens per step; the sequence that crosses the token budget is
  prefilled in chunks over several steps.
- Otherwise decode every running sequence (one token each). When the running sequences need more
  new blocks than are free, the most recently admitted ones are preempted: their blocks are freed
  and they go back to the front of the waiting queue, to be recomputed (prefix cache hits
  included) with the tokens they had generated.
- Finished sequences (stop token, or their length limit) release their blocks at once, so waiting
  ones join the next step.
- Sliding-window layers (a model with both kinds of layer): their blocks come from a pool of their
  own (:class:`~tidal.engine.native.window_blocks.WindowBlocks`), taken with the full layers' blocks
  and given back as each step's window moves past them; a sequence is admitted, and decodes, only
  when both pools have its blocks.
- Speculation: :meth:`attach_drafts` turns a decode batch into a verify batch (blocks for the
  drafted positions taken from the free ones, drafts cut to fit, never preempting);
  :meth:`postprocess` appends each row's accepted tokens and gives back the blocks past the last
  computed KV, leaving the table as plain steps would have.
- Overlap: while a step runs on the device, :meth:`schedule_ahead` may schedule the next one
  before its sampled tokens are known. After a decode step: every running sequence decodes again,
  its input token fed on the device, when that is what :meth:`schedule` would do anyway (nothing
  waits, no block is short); a sequence that the pending step finishes with a stop token then has
  a void row in the step ahead, whose token is dropped. After a prefill step: the next prefill
  (more waiting sequences admitted, or the next chunk), which needs no sampled token; when nothing
  waits, the decode of every running sequence (the just-prefilled ones fed from the prefill's
  samples). Whether the pending step stops a sequence is unknown, so with sequences waiting the
  step after a decode is not scheduled ahead (a stop would admit one first), unless no admission
  can happen then: the ``max_num_seqs`` cap is reached and no running sequence can finish (no stop
  tokens, none at its length).

Everything per sequence is read from and written to the :class:`SequenceTable`'s arrays: a decode
step of thousands of rows costs a few numpy operations (scheduling, stop checks, appending the
tokens, registering the blocks that filled up); Python loops run only over events (admissions,
preemptions, finished sequences).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from typing import Callable

import numpy as np

from tidal.engine.native.block_manager import BlockManager, block_digests, chain_hashes, prefix_hashes, seed_of
from tidal.engine.native.sequence import ABORT, LENGTH, STOP, SequenceTable, Status
from tidal.engine.native.state_pool import StatePool
from tidal.engine.native.window_blocks import WindowBlocks


@dataclasses.dataclass
class Batch:
    """One step over slots ``rows`` (``gens``: the slots' owners when scheduled).

    Prefill: row i computes ``num_new[i]`` tokens from position ``start[i]``; ``sampling[i]``: it
    samples a token (the chunk that reaches its last token). Decode: every row computes one token and
    samples; ``src_rows`` (scheduled ahead): the index in the previous batch's samples of each row's
    input token, -1 for a row whose input token is already known (a decode after a prefill). Verify
    (a decode batch with drafts): row i also feeds its ``draft_lens[i]`` drafted tokens (``drafts``,
    concatenated in row order) and computes ``draft_lens[i] + 1`` positions."""

    rows: np.ndarray
    gens: np.ndarray
    is_prefill: bool
    num_new: np.ndarray | None = None
    sampling: np.ndarray | None = None
    start: np.ndarray | None = None
    src_rows: np.ndarray | None = None
    draft_lens: np.ndarray | None = None
    drafts: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        if self.is_prefill:
            return int(self.num_new.sum())
        return len(self.rows) + (len(self.drafts) if self.drafts is not None else 0)


class Scheduler:
    def __init__(self, table: SequenceTable, block_manager: BlockManager, *, max_num_seqs: int | None,
                 max_num_batched_tokens: int, state_pool: StatePool | None = None,
                 window_blocks: WindowBlocks | None = None):
        """``state_pool``: the recurrent-state slots of a hybrid model (None: KV only). With one, a
        sequence is admitted only when it gets a state slot, a prefix hit is taken only up to a
        checkpointed boundary, and the first of a group's samples prefills up to the last block
        boundary before its last token in a chunk of its own, checkpointed for the others to fork
        from (:mod:`~tidal.engine.native.state_pool`). ``window_blocks``: the sliding-window layers'
        block pool (None: every attention layer's blocks are ``block_manager``'s)."""
        if state_pool is not None and window_blocks is not None:
            raise ValueError("a model with both recurrent and sliding-window layers is not supported by the native engine "
                             "(its prefix hits would need a state checkpoint and a cached window at one boundary)")
        self.table = table
        self.win = window_blocks
        self.bm = block_manager
        self.states = state_pool
        self.block_size = block_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[int] = deque()  # slots
        self.num_preemptions = 0
        self.ahead_off = ""  # why the last schedule_ahead gave None (engine.AHEAD_OFF)
        self._order = itertools.count()
        self.stop_sets: list[np.ndarray] = []
        self._stop_set_ids: dict[frozenset[int], int] = {}
        # called with the slots that finish, while they still hold their blocks (the engine reads an MoE
        # sequence's routing through them)
        self.before_release: Callable[[np.ndarray], None] | None = None

    # ---- requests -------------------------------------------------------------------------------
    def stop_set(self, ids: frozenset[int]) -> int:
        """The id of a set of stop tokens (a sequence's ``stop_set``)."""
        if ids not in self._stop_set_ids:
            self._stop_set_ids[ids] = len(self.stop_sets)
            self.stop_sets.append(np.array(sorted(ids), dtype=np.int64))
        return self._stop_set_ids[ids]

    def check_fits(self, num_prompt: int, max_len: int, what: str = "a sequence") -> None:
        """ValueError naming ``what`` unless a sequence of ``num_prompt`` prompt tokens growing to
        ``max_len`` tokens could ever fit in the cache (the one check of it)."""
        kv_tokens = max_len - 1  # the last sampled token is never fed back
        if -(-kv_tokens // self.block_size) > self.bm.num_blocks:
            raise ValueError(
                f"{what} of {num_prompt} prompt tokens + {max_len - num_prompt} new ones needs more KV blocks than the "
                f"cache has ({self.bm.num_blocks} of {self.block_size} tokens)"
            )
        # resumed after a preemption, it prefills all but its last token at once: every window block of them for a step
        if self.win is not None and -(-kv_tokens // self.block_size) > self.win.num_blocks:
            raise ValueError(
                f"{what} of {num_prompt} prompt tokens + {max_len - num_prompt} new ones needs more KV blocks than the "
                f"sliding-window layers' cache has ({self.win.num_blocks} of {self.block_size} tokens)"
            )

    def add(self, slot: int) -> None:
        """Queue the (waiting) sequence in ``slot``; raises if it could never fit in the cache."""
        self.check_fits(int(self.table.num_prompt[slot]), int(self.table.max_len[slot]))
        self.waiting.append(slot)

    @property
    def num_running(self) -> int:
        return int(np.count_nonzero(self.table.status == Status.RUNNING))

    # ---- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> Batch:
        if self.states is not None:
            self.states.begin_step()
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        if batch is None:  # decode preempted everything it held: the preempted ones prefill again
            batch = self._schedule_prefill()
        if batch is None:
            raise RuntimeError("scheduler could not make progress (KV cache too small)")
        return batch

    def _schedule_prefill(self) -> Batch | None:
        t = self.table
        rows, num_new, sampling, start = [], [], [], []
        budget = self.max_num_batched_tokens
        running = self.num_running if self.max_num_seqs is not None else 0
        groups = self._waiting_groups() if self.states is not None and self.bm.prefix_caching else None
        while self.waiting and budget > 0 and (self.max_num_seqs is None or running + len(rows) < self.max_num_seqs):
            s = self.waiting[0]
            if t.num_blocks[s] == 0 and not self._allocate(s):
                break
            cached = int(t.num_cached[s])
            todo = int(t.num_tokens[s]) - cached
            n = min(todo, budget)
            fork_at = self._fork_point(s, cached, groups)
            if fork_at:
                n = min(n, fork_at - cached)
            budget -= n
            if self.win is not None:
                self.win.slide(np.array([s]), np.array([cached]))
            self._register(s, cached + n)
            if fork_at and cached + n == fork_at:
                self.states.save(s, int(t.last_hash[s]))
            t.num_cached[s] = cached + n  # computed by the step being scheduled (before any later one)
            rows.append(s)
            num_new.append(n)
            sampling.append(n == todo)
            start.append(cached)
            if n < todo:
                break  # chunked: the rest in the next step(s)
            self.waiting.popleft()
            t.status[s] = Status.RUNNING
            t.order[s] = next(self._order)
        if not rows:
            return None
        rows = np.array(rows, dtype=np.int64)
        return Batch(rows, t.gen[rows].copy(), True, np.array(num_new, dtype=np.int64), np.array(sampling, dtype=bool),
                     np.array(start, dtype=np.int64))

    def _allocate(self, s: int) -> bool:
        """Give the waiting sequence in slot ``s`` its blocks (cached prefix shared); False if short."""
        t, bs = self.table, self.block_size
        n = int(t.num_tokens[s])
        seed = seed_of(t.seqs[s].cache_key)
        hashes, hits = self.bm.lookup(t.tokens[s, :n], seed)
        need = -(-n // bs)
        checkpoint = None
        if self.states is not None:
            if hits and self.states.pending(hashes[len(hits) - 1]):
                return False  # its prefix's state is checkpointed by the step being scheduled: fork next step
            k, checkpoint = self.states.lookup(hashes[: len(hits)])
            hashes, hits = hashes[:k], hits[:k]  # KV hits only up to a boundary whose state is known
            if not self.states.can_admit():
                return False
        if self.win is not None:
            k, win_hits = self.win.lookup(hashes[: len(hits)], t.tokens[s, :n])
            hashes, hits = hashes[:k], hits[:k]  # KV hits only up to a boundary whose last window is cached too
            if not self.win.can_admit(need, k, win_hits):
                return False
        if not self.bm.can_allocate(need, hits):
            return False
        if self.states is not None:
            self.states.admit(s, checkpoint)
        if self.win is not None:
            self.win.admit(s, need, len(hits), win_hits)
        t.block_table[s, :need] = self.bm.allocate(need, hits)
        t.num_blocks[s] = need
        t.num_cached[s] = len(hits) * bs
        t.num_hashed[s] = len(hits)
        t.last_hash[s] = hashes[-1] if hashes else seed
        return True

    def _waiting_groups(self) -> dict:
        """Waiting sequences per group id (the samples of one prompt share it)."""
        counts: dict = {}
        for s in self.waiting:
            g = self.table.seqs[s].group_id
            counts[g] = counts.get(g, 0) + 1
        return counts

    def _fork_point(self, s: int, cached: int, groups: dict | None) -> int:
        """The block boundary before slot ``s``'s last token where its prefill stops for a checkpoint
        the other waiting samples of its group fork from; 0 for none (no pool, no prefix caching,
        no sibling waiting, or already past it)."""
        if groups is None:
            return 0
        g = self.table.seqs[s].group_id
        if g is None or groups.get(g, 0) < 2:
            return 0
        p = (int(self.table.num_tokens[s]) - 1) // self.block_size * self.block_size
        return p if p > cached else 0

    def _register(self, s: int, num_tokens: int) -> None:
        """Register the full blocks among slot ``s``'s first ``num_tokens`` tokens (their KV is
        computed in the step being scheduled) so other sequences can share them."""
        t, bs = self.table, self.block_size
        lo, hi = int(t.num_hashed[s]), num_tokens // bs
        if not self.bm.prefix_caching or hi <= lo:
            return
        blocks_KB = t.tokens[s, lo * bs : hi * bs].reshape(hi - lo, bs)
        hashes = prefix_hashes(blocks_KB, int(t.last_hash[s]))
        self.bm.register(t.block_table[s, lo:hi], hashes, blocks_KB)
        if self.win is not None:
            self.win.register(np.full(hi - lo, s), np.arange(lo, hi), hashes, blocks_KB)
        t.num_hashed[s], t.last_hash[s] = hi, hashes[-1]

    def _schedule_decode(self) -> Batch | None:
        t = self.table
        rows = t.slots_with(Status.RUNNING)
        if not len(rows):
            return None
        if self.win is not None:
            self.win.slide(rows, t.num_tokens[rows] - 1)
        need = t.num_tokens[rows] > t.num_blocks[rows] * self.block_size  # KV of the last token needs a new block
        short = int(need.sum()) - self._free_blocks()
        if short > 0:
            keep = np.ones(len(rows), dtype=bool)
            for i in np.argsort(-t.order[rows], kind="stable").tolist():  # the most recently admitted first
                if int(need[keep].sum()) <= self._free_blocks():
                    break
                keep[i] = False
                self._preempt(int(rows[i]))
            rows, need = rows[keep], need[keep]
            if not len(rows):
                return None
        self._append_blocks(rows[need])
        self._save_boundaries(rows, t.num_tokens[rows])
        return Batch(rows, t.gen[rows].copy(), False)

    def _save_boundaries(self, rows: np.ndarray, covered: np.ndarray) -> None:
        """Checkpoint the state of the decode ``rows`` whose step ends at a block boundary (after it
        their state covers ``covered`` tokens): a later turn of the conversation, or the sequence
        itself resumed after a preemption, continues from there (hash bound in postprocess)."""
        if self.states is None or not self.bm.prefix_caching:
            return
        at = np.flatnonzero(covered % self.block_size == 0)
        for s, b in zip(rows[at].tolist(), covered[at].tolist()):
            self.states.save(s, None, b)

    def _free_blocks(self) -> int:
        """Blocks a step may take for new columns: free in the full pool and, with window layers, in theirs."""
        free = self.bm.num_free_blocks
        return free if self.win is None else min(free, self.win.num_free_blocks)

    def _append_blocks(self, slots: np.ndarray) -> None:
        t = self.table
        if len(slots):
            t.block_table[slots, t.num_blocks[slots]] = self.bm.take(len(slots))
            if self.win is not None:
                self.win.append(slots)
            t.num_blocks[slots] += 1

    def attach_drafts(self, batch: Batch, drafts: list[np.ndarray | None], max_rows: int | None = None) -> Batch:
        """The decode ``batch`` turned into a verify batch with ``drafts[i]`` for row i (None or empty:
        a plain row), each cut to the blocks free now (drafts never preempt) and, with ``max_rows``, to
        that many rows in all. Takes the blocks the drafted positions need. ``batch`` itself when no
        draft is left."""
        t, bs = self.table, self.block_size
        lens = np.array([0 if d is None else len(d) for d in drafts], dtype=np.int64)
        if max_rows is not None:
            budget = max(0, max_rows - len(lens))
            lens = np.minimum(lens, np.maximum(0, budget - (np.cumsum(lens) - lens)))
        n, have = t.num_tokens[batch.rows], t.num_blocks[batch.rows]
        need = np.maximum(0, -(-(n + lens) // bs) - have)  # blocks for positions up to n - 1 + k
        free = self._free_blocks()
        if need.sum() > free:  # cut the drafts in row order to the free blocks
            room = np.maximum(0, free - (np.cumsum(need) - need))
            lens = np.minimum(lens, np.maximum(0, (have + room) * bs - n))
            need = np.minimum(need, np.maximum(0, -(-(n + lens) // bs) - have))
        if need.any():
            got = self.bm.take(int(need.sum()))
            r = np.repeat(np.arange(len(need)), need)
            j = np.arange(len(got)) - np.repeat(np.cumsum(need) - need, need)
            t.block_table[batch.rows[r], have[r] + j] = got
            if self.win is not None:
                self.win.place(batch.rows[r], have[r] + j)
            t.num_blocks[batch.rows] = have + need
        if not lens.any():
            return batch
        flat = np.concatenate([d[:k] for d, k in zip(drafts, lens.tolist()) if k]).astype(np.int64)
        return dataclasses.replace(batch, draft_lens=lens, drafts=flat)

    def schedule_ahead(self, batch: Batch) -> Batch | None:
        """The step after ``batch`` (still running, tokens unknown; every earlier batch postprocessed),
        or None when it cannot be known yet (``ahead_off`` says why). After a prefill: the
        next prefill if sequences wait and fit; when none waits, the decode of every running sequence
        (the prefilled ones' input tokens come from ``batch``'s samples). After a decode: the next
        decode, unless sequences wait or a block would be short. Each is the step :meth:`schedule`
        would make once ``batch`` is postprocessed, but for the void rows of sequences that ``batch``
        stops."""
        if self.states is not None:
            self.states.begin_step()
        if batch.is_prefill:
            if self.waiting:
                return self._schedule_prefill() or self._off("waiting")
            return self._decode_after_prefill(batch)
        if batch.draft_lens is not None:  # a verify step's lengths are not known yet
            return self._off("verify")
        t, rows = self.table, batch.rows
        live = (t.gen[rows] == batch.gens) & (t.status[rows] == Status.RUNNING)
        if self.waiting and not self._admits_none(rows[live]):
            return self._off("waiting")
        if int(live.sum()) != self.num_running:
            return self._off("not_in_step")
        src = np.flatnonzero(live & (t.num_tokens[rows] + 1 < t.max_len[rows]))  # not finished by length
        return self._decode_ahead(rows[src], src, np.ones(len(src), dtype=bool))

    def _admits_none(self, slots: np.ndarray) -> bool:
        """Whether, with sequences waiting, :meth:`schedule` surely admits none once the decode of
        ``slots`` (every running sequence) is postprocessed: the ``max_num_seqs`` cap is reached and
        none of them can finish in it (no stop tokens, none at its length). Otherwise a stop or a
        finish in that step may free room (blocks, a slot, new prefix hits) for an admission first."""
        t = self.table
        if self.max_num_seqs is None or len(slots) < self.max_num_seqs:
            return False
        if any(len(self.stop_sets[k]) for k in np.unique(t.stop_set[slots]).tolist()):
            return False
        return not bool((t.num_tokens[slots] + 1 >= t.max_len[slots]).any())

    def _decode_after_prefill(self, batch: Batch) -> Batch | None:
        """Every running sequence decodes: those ``batch`` samples for (not finished by length) one
        token past their length, fed from its samples; the others from their last known token."""
        t = self.table
        sampled = batch.rows[batch.sampling]
        pos = {s: i for i, s in enumerate(sampled.tolist())}  # row of each prefilled slot in batch's samples
        rows = t.slots_with(Status.RUNNING)
        src = np.array([pos.get(s, -1) for s in rows.tolist()], dtype=np.int64)
        ahead = src >= 0
        keep = ~ahead | (t.num_tokens[rows] + 1 < t.max_len[rows])
        return self._decode_ahead(rows[keep], src[keep], ahead[keep])

    def _decode_ahead(self, rows: np.ndarray, src: np.ndarray, ahead: np.ndarray) -> Batch | None:
        """A decode batch of ``rows``, ``ahead`` of them one token past their length, if their blocks fit."""
        if not len(rows):
            return self._off("all_finish")
        t = self.table
        if self.win is not None:
            self.win.slide(rows, t.num_tokens[rows] - 1 + ahead)
        need = t.num_tokens[rows] + ahead > t.num_blocks[rows] * self.block_size
        if int(need.sum()) > self._free_blocks():
            return self._off("blocks_short")
        self._append_blocks(rows[need])
        self._save_boundaries(rows, t.num_tokens[rows] + ahead)
        return Batch(rows, t.gen[rows].copy(), False, src_rows=np.where(ahead, src, -1))

    def _off(self, reason: str) -> None:
        self.ahead_off = reason
        return None

    # ---- after a step ---------------------------------------------------------------------------
    def postprocess(self, batch: Batch, token_ids: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
        """Advance the sequences of ``batch`` past the step; ``token_ids``/``logprobs`` hold one entry
        per sampling row, in batch order. Returns the slots that finished (status FINISHED, blocks
        released, ``finish`` set); the caller reads them and releases the slots."""
        t = self.table
        rows = batch.rows
        status = t.status[rows]
        live = (t.gen[rows] == batch.gens) & ((status == Status.RUNNING) | (status == Status.WAITING))
        if batch.draft_lens is not None:
            return self._postprocess_verify(batch, live, token_ids, logprobs)
        if batch.is_prefill:  # its KV was counted when it was scheduled
            samp = batch.sampling
            keep = live[samp]
            srows, token_ids, logprobs = rows[samp][keep], token_ids[keep], logprobs[keep]
        else:
            srows = rows[live]
            token_ids, logprobs = token_ids[live], logprobs[live]
            t.num_cached[srows] = t.num_tokens[srows]  # the KV of the input token is in
            if self.bm.prefix_caching:
                self._register_filled(srows)
        if not len(srows):
            return srows
        n = t.num_tokens[srows]
        t.reserve_length(int(n.max()) + 1)
        t.tokens[srows, n] = token_ids
        t.logprobs[srows, n] = logprobs
        t.num_tokens[srows] = n + 1
        stop = self._is_stop(srows, token_ids)
        done = stop | (n + 1 >= t.max_len[srows])
        finished = srows[done]
        if len(finished):
            t.finish[finished] = np.where(stop[done], STOP, LENGTH)
            self._finish(finished)
        return finished

    def _postprocess_verify(self, batch: Batch, live: np.ndarray, token_ids: np.ndarray,
                            logprobs: np.ndarray) -> np.ndarray:
        """:meth:`postprocess` of a verify batch: ``token_ids``/``logprobs`` hold one entry per
        computed position (``draft_lens[i] + 1`` per row, void ones < 0 past the first rejection).
        Each live row appends its emitted tokens up to a stop token or its length limit; KV counts as
        computed for every appended token but the last (the rejected drafts' KV is garbage past
        ``num_cached``, overwritten when those positions are computed again), and the blocks taken
        for positions past it are given back: the table is what plain steps would have left."""
        t = self.table
        reps = batch.draft_lens + 1
        width = int(reps.max())
        cu = np.concatenate([[0], np.cumsum(reps)])
        col = np.arange(len(token_ids)) - np.repeat(cu[:-1], reps)
        toks_RW = np.full((len(reps), width), -1, dtype=np.int64)
        logp_RW = np.zeros((len(reps), width), dtype=np.float64)
        toks_RW[np.repeat(np.arange(len(reps)), reps), col] = token_ids
        logp_RW[np.repeat(np.arange(len(reps)), reps), col] = logprobs
        emitted = (toks_RW >= 0).sum(axis=1)
        srows, emitted, toks_RW, logp_RW = batch.rows[live], emitted[live], toks_RW[live], logp_RW[live]
        if not len(srows):
            return srows
        n = t.num_tokens[srows]
        stop_RW = self._is_stop(np.repeat(srows, width), toks_RW.reshape(-1)).reshape(toks_RW.shape)
        stop_RW &= np.arange(width)[None, :] < emitted[:, None]
        first_stop = np.where(stop_RW.any(axis=1), stop_RW.argmax(axis=1) + 1, width + 1)
        m = np.minimum(np.minimum(emitted, first_stop), t.max_len[srows] - n)
        t.reserve_length(int((n + m).max()))
        r_idx = np.repeat(np.arange(len(srows)), m)
        c_idx = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        t.tokens[srows[r_idx], n[r_idx] + c_idx] = toks_RW[r_idx, c_idx]
        t.logprobs[srows[r_idx], n[r_idx] + c_idx] = logp_RW[r_idx, c_idx]
        t.num_tokens[srows] = n + m
        t.num_cached[srows] = n + m - 1
        if self.bm.prefix_caching:
            self._register_filled(srows)
        stop = first_stop <= m
        done = stop | (n + m >= t.max_len[srows])
        self._trim_blocks(srows[~done])
        finished = srows[done]
        if len(finished):
            t.finish[finished] = np.where(stop[done], STOP, LENGTH)
            self._finish(finished)
        return finished

    def _trim_blocks(self, slots: np.ndarray) -> None:
        """Give back the blocks of ``slots`` past the one holding position ``num_cached - 1``."""
        t = self.table
        keep = -(-t.num_cached[slots] // self.block_size)
        extra = t.num_blocks[slots] - keep
        for s, k, e in zip(slots.tolist(), keep.tolist(), extra.tolist()):
            if e > 0:
                if self.win is not None:
                    self.win.trim(s, k)
                self.bm.release(t.block_table[s, k : k + e][::-1].copy())
                t.block_table[s, k : k + e] = 0
                t.num_blocks[s] = k

    def _register_filled(self, slots: np.ndarray) -> None:
        """Register the blocks ``slots`` completed with this step's KV (one per decode step; up to
        a verify step's accepted length)."""
        t, bs = self.table, self.block_size
        while True:
            filled = slots[t.num_cached[slots] // bs > t.num_hashed[slots]]
            if not len(filled):
                return
            j = t.num_hashed[filled]
            blocks_KB = t.tokens[filled[:, None], j[:, None] * bs + np.arange(bs)]
            hashes = chain_hashes(t.last_hash[filled], block_digests(blocks_KB))
            self.bm.register(t.block_table[filled, j], hashes, blocks_KB)
            if self.win is not None:
                self.win.register(filled, j, hashes, blocks_KB)
            if self.states is not None:
                for s, b, h in zip(filled.tolist(), ((j + 1) * bs).tolist(), hashes.tolist()):
                    self.states.bind(s, b, h)
            t.last_hash[filled] = hashes
            t.num_hashed[filled] = j + 1

    def _is_stop(self, slots: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        sets = self.table.stop_set[slots]
        if len(self.stop_sets) == 1:
            return np.isin(token_ids, self.stop_sets[0])
        stop = np.zeros(len(slots), dtype=bool)
        for k in np.unique(sets).tolist():
            m = sets == k
            stop[m] = np.isin(token_ids[m], self.stop_sets[k])
        return stop

    def _release_blocks(self, slots: np.ndarray) -> None:
        """Give back the blocks of ``slots`` (each sequence's last block first, so its prefix stays
        cached longest)."""
        t = self.table
        held = [t.blocks_of(s)[::-1] for s in slots.tolist() if t.num_blocks[s]]
        if held:
            self.bm.release(np.concatenate(held))
        if self.win is not None:
            self.win.release(slots)
        if self.states is not None:
            for s in slots.tolist():
                self.states.free(s)
        for s in slots.tolist():  # block 0 pads the rows: the torch kernels gather up to the longest row
            t.block_table[s, : t.num_blocks[s]] = 0
        t.num_blocks[slots] = t.num_cached[slots] = t.num_hashed[slots] = 0

    def _finish(self, slots: np.ndarray) -> None:
        self.table.status[slots] = Status.FINISHED
        if self.before_release is not None:
            self.before_release(slots)
        self._release_blocks(slots)

    def _preempt(self, s: int) -> None:
        self.num_preemptions += 1
        self._release_blocks(np.array([s]))
        self.table.status[s] = Status.WAITING
        self.waiting.appendleft(s)

    def drop(self, batch: Batch) -> None:
        """``batch`` ran but is not postprocessed (dropped by an abort). Its decode rows compute their
        token again, which is exact for KV (rewritten in place) but would apply it twice to a
        recurrent state: with a state pool the live sequences of a dropped decode batch are
        preempted (they re-prefill, from their last checkpoint)."""
        if self.states is None or batch.is_prefill:
            return
        t, rows = self.table, batch.rows
        live = (t.gen[rows] == batch.gens) & (t.status[rows] == Status.RUNNING)
        for s in rows[live].tolist():
            self._preempt(s)

    def abort(self, slots: np.ndarray) -> None:
        """Stop the unfinished sequences in ``slots`` (waiting or running): blocks released, status
        FINISHED with the ``abort`` code."""
        gone = set(slots.tolist())
        self.waiting = deque(s for s in self.waiting if s not in gone)
        self.table.finish[slots] = ABORT
        self._finish(slots)
