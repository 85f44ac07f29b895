"""Continuous batching: which sequences run in the next step, and what happens after it.

Policy (the nano-vllm shape):
- Prefill first: waiting sequences are admitted in order while their blocks fit, up to
  ``max_num_seqs`` running sequences and ``max_num_batched_tokens`` new tokens per step; the
  sequence that crosses the token budget is prefilled in chunks over several steps.
- Otherwise decode every running sequence (one token each). When a sequence needs a new block and
  none is free, the most recently admitted running sequence is preempted: its blocks are freed and
  it goes back to the front of the waiting queue, to be recomputed (prefix cache hits included)
  with the tokens it had generated.
- Finished sequences (stop token, or ``max_tokens``) release their blocks at once, so waiting ones
  join the next step.
- Overlap: while a decode step runs on the device, :meth:`schedule_ahead` may schedule the next one
  before the sampled tokens are known (every running sequence decodes again, its input token fed
  on the device). It only does so when that is what :meth:`schedule` would do anyway: nothing
  waits, no block is short. A sequence that the pending step finishes with a stop token then has
  a void row in the step ahead, whose token is dropped.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from tidal.engine.native.block_manager import BlockManager
from tidal.engine.native.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class Batch:
    """One step. ``seqs[i]`` computes ``num_scheduled_tokens`` tokens; ``sampling[i]`` says whether
    that row samples a token this step (decode, or the prefill chunk that reaches the last token)."""

    seqs: list[Sequence]
    is_prefill: bool
    sampling: list[bool]
    src_rows: list[int] | None = None  # scheduled ahead: row of the previous batch holding each input token

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        kv_tokens = len(seq) + seq.max_tokens - 1  # the last sampled token is never fed back
        if (kv_tokens + self.bm.block_size - 1) // self.bm.block_size > self.bm.num_blocks:
            raise ValueError(
                f"a sequence of {len(seq)} prompt tokens + {seq.max_tokens} new ones needs more KV blocks "
                f"than the cache has ({self.bm.num_blocks} of {self.bm.block_size} tokens)"
            )
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Batch:
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        if batch is None:  # decode preempted everything it held: the preempted ones prefill again
            batch = self._schedule_prefill()
        if batch is None:
            raise RuntimeError("scheduler could not make progress (KV cache too small)")
        return batch

    def _schedule_prefill(self) -> Batch | None:
        seqs: list[Sequence] = []
        sampling: list[bool] = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                hits = self.bm.can_allocate(seq)
                if hits is None:
                    break
                self.bm.allocate(seq, hits)
            todo = len(seq) - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(todo, budget)
            budget -= seq.num_scheduled_tokens
            self.bm.register_computed(seq, seq.num_cached_tokens + seq.num_scheduled_tokens)
            seqs.append(seq)
            sampling.append(seq.num_scheduled_tokens == todo)
            if seq.num_scheduled_tokens < todo:
                break  # chunked: the rest in the next step(s)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
        # sequences that finished prefill join the running queue after this step's bookkeeping
        self.running.extend(s for s, last in zip(seqs, sampling) if last)
        return Batch(seqs, True, sampling) if seqs else None

    def _schedule_decode(self) -> Batch | None:
        seqs: list[Sequence] = []
        while self.running and len(seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.bm.append_slot(seq)
                seq.num_scheduled_tokens = 1
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        return Batch(seqs, False, [True] * len(seqs)) if seqs else None

    def schedule_ahead(self, batch: Batch) -> Batch | None:
        """The decode step after ``batch`` (still running, tokens unknown), or None when it cannot be
        known yet: ``batch`` is a prefill, sequences wait, or a block would be short."""
        live = [s.status is SequenceStatus.RUNNING for s in batch.seqs]
        if batch.is_prefill or self.waiting or sum(live) != len(self.running):
            return None
        rows, seqs, new_blocks = [], [], 0
        for i, seq in enumerate(batch.seqs):
            if not live[i] or seq.num_completion_tokens + 1 >= seq.max_tokens:
                continue  # a void row, or finishes with this token
            rows.append(i)
            seqs.append(seq)
            new_blocks += len(seq) + 1 > len(seq.block_table) * self.bm.block_size
        if not seqs or new_blocks > self.bm.num_free_blocks:
            return None
        for seq in seqs:
            self.bm.append_slot(seq, len(seq) + 1)
        return Batch(seqs, False, [True] * len(seqs), src_rows=rows)

    def commit_ahead(self, ahead: Batch) -> None:
        """After the previous batch's postprocess: the sequences of ``ahead`` that are still running
        compute one token in it (the others' rows are void)."""
        for seq in ahead.seqs:
            if seq.status is SequenceStatus.RUNNING:
                seq.num_scheduled_tokens = 1

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.bm.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: Batch, token_ids: list[int], logprobs: list[float], stop_ids: frozenset[int]) -> None:
        """Advance the sequences of ``batch`` past the step; ``token_ids``/``logprobs`` hold one entry
        per sampling row, in batch order."""
        k = 0
        finished = False
        for seq, samples in zip(batch.seqs, batch.sampling):
            if seq.status is SequenceStatus.FINISHED:  # void row of a batch scheduled ahead
                k += samples
                continue
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.bm.register_computed(seq, seq.num_cached_tokens)
            if not samples:
                continue
            tok = token_ids[k]
            seq.append(tok, logprobs[k])
            k += 1
            if tok in stop_ids:
                seq.finish_reason = "stop"
            elif seq.num_completion_tokens >= seq.max_tokens:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = SequenceStatus.FINISHED
            self.bm.deallocate(seq)
            finished = True
        if finished:
            self.running = deque(s for s in self.running if s.status is SequenceStatus.RUNNING)
