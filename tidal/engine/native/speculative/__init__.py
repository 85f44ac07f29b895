"""Lossless speculative decoding inside :class:`~tidal.engine.native.NativeEngine` (``engine.speculative``).

:class:`Speculator` is what the engine's step loop talks to: it keeps the draft index
(:mod:`.draft_index`) and each sequence's draft state, proposes drafts for a scheduled decode
batch, and learns from the verified result (:mod:`.policy`). Verification itself is a decode step
with ``k + 1`` rows per drafting sequence (:meth:`ModelRunner.launch`), accepted exactly by
:mod:`.acceptance`; the scheduler turns the result into tokens, KV and blocks
(:meth:`Scheduler.attach_drafts`, :meth:`Scheduler.postprocess`).
"""

from __future__ import annotations

import numpy as np

from tidal.engine.native.sequence import Status
from tidal.engine.native.speculative.draft_index import DraftIndex
from tidal.engine.native.speculative.policy import SeqDraftState, SpecPolicy

# counters the speculator adds to ``NativeEngine.stats``
STAT_KEYS = ("spec_steps", "spec_seqs", "spec_drafted", "spec_accepted", "spec_rows", "spec_plain_rows")


class Speculator:
    """Drafts and their bookkeeping for one engine. ``mode``: ``engine.speculative``;
    ``latency_bound``: see :class:`SpecPolicy` (False on CPU: ``auto`` never speculates there).

    ``stats`` (cumulative): ``spec_steps`` (decode steps that verified drafts), ``spec_seqs``
    (drafting sequences over them), ``spec_drafted`` / ``spec_accepted`` (drafted tokens / kept),
    ``spec_rows`` (rows those steps computed) and ``spec_plain_rows`` (rows a plain step would have)."""

    def __init__(self, mode: str, latency_bound: bool = True):
        self.policy = SpecPolicy(mode, latency_bound)
        self.index = DraftIndex()
        self.states: dict[int, SeqDraftState] = {}
        self.step = 0  # decode steps launched (counted by the engine)
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    @property
    def enabled(self) -> bool:
        """Whether this engine may ever speculate (else it keeps no index either)."""
        return self.policy.mode == "on" or (self.policy.mode == "auto" and self.policy.latency_bound)

    # ---- sequences ------------------------------------------------------------------------------
    def add(self, seq) -> None:
        if self.enabled:
            self.index.add(seq.seq_id, seq.prompt_ids, seq.group_id)
            self.states[seq.seq_id] = SeqDraftState()

    def finish(self, seq, row: np.ndarray) -> None:
        """``seq`` finished or was aborted with text ``row``: kept for its prompt's later sequences."""
        if self.enabled:
            self.index.finish(seq.seq_id, row)
            del self.states[seq.seq_id]

    # ---- steps ----------------------------------------------------------------------------------
    def wants(self, table) -> bool:
        """Whether the next decode step over the running sequences may draft (then it must not be
        scheduled ahead: drafts need the last tokens)."""
        if not self.enabled:
            return False
        slots = table.slots_with(Status.RUNNING)
        if not self.policy.allows(self.step + 1, len(slots)):
            return False
        return any(self.states[table.seqs[s].seq_id].wake_step <= self.step + 1 for s in slots.tolist())

    def propose(self, table, rows: np.ndarray) -> list[np.ndarray | None]:
        """Drafts for the decode batch (the next step) over slots ``rows`` (None: a plain row), within
        each sequence's draft length and its length limit."""
        now = self.step + 1
        if not self.enabled or not self.policy.allows(now, len(rows)):
            return [None] * len(rows)
        out = []
        for s in rows.tolist():
            seq, n = table.seqs[s], int(table.num_tokens[s])
            state = self.states[seq.seq_id]
            room = int(table.max_len[s]) - n - 1  # the last row emits one token beyond the drafts
            if state.wake_step > now or room < 1:
                out.append(None)
                continue
            text = table.tokens[s, :n]
            self.index.update(seq.seq_id, text)
            out.append(self.index.propose(seq.seq_id, text, min(state.k, room)))
        return out

    def observe(self, table, batch, token_ids: np.ndarray) -> None:
        """After the verify ``batch`` emitted ``token_ids`` (one per computed position, void < 0);
        called before its finished sequences' slots are released."""
        k = batch.draft_lens
        accepted = np.add.reduceat(token_ids >= 0, np.cumsum(k + 1) - (k + 1)) - 1
        for s, gen, drafted, a in zip(batch.rows.tolist(), batch.gens.tolist(), k.tolist(), accepted.tolist()):
            seq = table.seqs[s]
            if seq is not None and table.gen[s] == gen and self.states[seq.seq_id].wake_step <= self.step:
                self.states[seq.seq_id].observe(drafted, a, self.step, self.policy.adaptive)
        drafting = int(np.count_nonzero(k))
        self.policy.observe(self.step, drafting, int(accepted.sum()))
        st = self.stats
        st["spec_steps"] += 1
        st["spec_seqs"] += drafting
        st["spec_drafted"] += int(k.sum())
        st["spec_accepted"] += int(accepted.sum())
        st["spec_rows"] += int(k.sum()) + len(k)
        st["spec_plain_rows"] += len(k)

    def observe_plain(self, table, rows: np.ndarray, gens: np.ndarray) -> None:
        """After a decode step whose rows found no draft: each counts as a miss."""
        if not self.enabled or not self.policy.allows(self.step, len(rows)):
            return
        self.policy.observe(self.step, 0, 0)
        for s, gen in zip(rows.tolist(), gens.tolist()):
            seq = table.seqs[s]
            if seq is not None and table.gen[s] == gen and self.states[seq.seq_id].wake_step <= self.step:
                self.states[seq.seq_id].observe(0, 0, self.step, self.policy.adaptive)

