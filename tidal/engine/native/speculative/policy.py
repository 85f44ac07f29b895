"""When to speculate (``engine.speculative``) and how far each sequence drafts.

A verify step computes ``k + 1`` rows for a drafting sequence where a plain step computes one. That
is nearly free while decode is latency-bound (few rows: the step's time is reading the weights, not
computing) and a loss once it is compute-bound, or when drafts are rejected. The policy decides from
quantities every TP rank holds identically (the number of running sequences, the acceptance so far),
never from clocks, so the ranks stay in lockstep without a collective:

- ``off``: never. ``on``: every decode step in which some sequence has a draft (tests, measurements).
- ``auto``: only on an accelerator (``latency_bound``: a CPU step is compute-bound at any batch),
  only while at most :data:`AUTO_MAX_RUNNING` sequences run, and not while the recent
  acceptance (an exponential mean over the steps that proposed drafts of accepted tokens per
  drafting sequence, a step that found no draft counting 0) is below :data:`AUTO_MIN_ACCEPTED`; then it pauses for a number of decode steps that doubles with
  each pause (from :data:`AUTO_PAUSE_STEPS`) and probes again. Per sequence (also under ``auto``
  only), a sequence whose drafts fail :data:`MISSES_TO_SLEEP` times in a row (nothing accepted, or
  no draft found) stops drafting for a number of its steps that doubles with each stop.

Draft length adapts per sequence: start at :data:`START_DRAFT`; after a verify that accepted all
``k`` drafts, ``k + 2``; else one more than it accepted; within ``[1, MAX_DRAFT]``.
"""

from __future__ import annotations

import dataclasses

START_DRAFT = 4
MAX_DRAFT = 8
MISSES_TO_SLEEP = 3
MAX_SLEEP_STEPS = 256
AUTO_MAX_RUNNING = 32
AUTO_MAX_VERIFY_ROWS = 128
AUTO_MIN_ACCEPTED = 0.5
AUTO_PAUSE_STEPS = 64
AUTO_MAX_PAUSE_STEPS = 4096
EMA = 0.2


@dataclasses.dataclass
class SeqDraftState:
    """One sequence's draft length and failure streak; ``wake_step``: the decode step from which it
    drafts again after a stop."""

    k: int = START_DRAFT
    misses: int = 0
    sleeps: int = 0
    wake_step: int = 0

    def observe(self, drafted: int, accepted: int, step: int, adaptive_sleep: bool) -> None:
        """After a step where it drafted ``drafted`` tokens (0: none found) and ``accepted`` were kept."""
        if drafted:
            self.k = min(MAX_DRAFT, self.k + 2) if accepted == drafted else max(1, accepted + 1)
        if accepted:
            self.misses = self.sleeps = 0
            return
        self.misses += 1
        if adaptive_sleep and self.misses >= MISSES_TO_SLEEP:
            self.misses = 0
            self.wake_step = step + min(MAX_SLEEP_STEPS, 2 ** (self.sleeps + 1))
            self.sleeps += 1


class SpecPolicy:
    """The step-level gate (see the module docstring). ``mode``: ``auto``, ``on`` or ``off``;
    ``latency_bound``: the engine runs on a device whose small decode steps are latency-bound."""

    def __init__(self, mode: str, latency_bound: bool = True):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"engine.speculative must be 'auto', 'on' or 'off', got {mode!r}")
        self.mode = mode
        self.latency_bound = latency_bound
        self.accepted_ema: float | None = None
        self.verifies = 0
        self.resume_step = 0
        self.pauses = 0

    @property
    def adaptive(self) -> bool:
        return self.mode == "auto"

    def allows(self, step: int, num_running: int) -> bool:
        """Whether the decode step numbered ``step`` with ``num_running`` sequences may speculate."""
        if self.mode != "auto":
            return self.mode == "on"
        return self.latency_bound and num_running <= AUTO_MAX_RUNNING and step >= self.resume_step

    def max_verify_rows(self) -> int | None:
        return AUTO_MAX_VERIFY_ROWS if self.mode == "auto" else None

    def observe(self, step: int, drafting: int, accepted: int) -> None:
        """After a decode step that proposed drafts, in which ``drafting`` sequences had drafts (0:
        none was found: it cost the step its overlap for nothing, and counts as nothing accepted)
        and ``accepted`` drafted tokens were kept in all."""
        mean = accepted / drafting if drafting else 0.0
        self.accepted_ema = mean if self.accepted_ema is None else (1 - EMA) * self.accepted_ema + EMA * mean
        self.verifies += 1
        if self.mode == "auto" and self.verifies >= 4 and self.accepted_ema < AUTO_MIN_ACCEPTED:
            self.resume_step = step + min(AUTO_MAX_PAUSE_STEPS, AUTO_PAUSE_STEPS * 2 ** self.pauses)
            self.pauses += 1
            self.accepted_ema, self.verifies = None, 0
            return
        if self.accepted_ema >= AUTO_MIN_ACCEPTED:
            self.pauses = 0
