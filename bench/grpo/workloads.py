"""What one benchmark case generates and trains, the workload matrix, and the ``natural`` lengths.

A :class:`Workload` is a model size, a rollout (``prompts`` x ``samples`` sequences of
``prompt_len`` prompt tokens) and how long the completions are:

- ``forced``: every completion is exactly ``max_new_tokens`` tokens (EOS ignored).
- ``natural``: completion j of rollout k is :func:`natural_lengths` ``(...)[j]`` tokens long, its
  last token EOS (``finish_reason: stop``), drawn from a seeded lognormal (``tail``): ``lognormal``,
  median a quarter of ``max_new_tokens``, about 3% reach the maximum; ``heavy``, median an eighth,
  about 10% reach the maximum (reasoning rollouts: most groups of 8 or 16 hold a capped sample).
  Those at the maximum end with EOS there too. Every framework reproduces the same draws: rollout
  k of Tidal and rollout k of TRL have the same lengths.

The rollout (``rollout``): ``plain`` (every group runs to its end), or the long-tail modes of
``rollout.partial`` (docs/partial_rollout.md), on ``natural`` lengths only: ``carry`` (partial
rollout: stop at ``prompts`` complete groups, resume the unfinished sequences next iteration) and
``drop`` (over-sample, drop the slowest groups). Their cases are named ``...-natural-carry`` and
``...-natural-drop``; a long-tail case's rollouts draw their lengths for the new sequences they start
(:meth:`Workload.completion_lengths` with ``count``), from the same distribution.

The long-tail matrix (:func:`long_tail_matrix`, ``matrix --long-tail``) crosses 0.5b, 1.5b and 7b,
128 and 512 sequences, 2k/8k/16k new tokens, groups of 8 and 16, both tails and the three rollouts,
on natural lengths. The matrix (:func:`matrix`) crosses the Qwen2.5 sizes, rollouts of 128, 512 and 2048 sequences
(``samples`` per prompt), 256 to 4096 new tokens, both length modes and, on natural lengths, the
three rollouts, and the same (plain rollouts) for on-policy distillation of a student by a larger
teacher of the same tokenizer (:data:`DISTILL_PAIRS`: 0.5b from 1.5b); ``--cases`` picks cases by
name (:func:`select`), e.g. ``0.5b-512x1024-*``. Names are ``SIZE-SEQSxNEW-LENGTHS``, with
``-heavy`` for the heavy tail, ``-g16`` for groups larger than 8, ``-carry``/``-drop`` for a long-tail
rollout, ``-kl`` for a KL case and ``-distillTEACHER`` for a distillation case
(``0.5b-512x1024-natural-distill1.5b``, ``1.5b-512x8192-natural-heavy-g16-carry``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import statistics
from typing import Literal

import numpy as np

from bench.grpo.shapes import FAMILY_SHAPES, SHAPES, SIZE_ORDER

LengthMode = Literal["forced", "natural"]
LENGTH_MODES: tuple[str, ...] = ("forced", "natural")
RolloutMode = Literal["plain", "carry", "drop"]
ROLLOUT_MODES: tuple[str, ...] = ("plain", "carry", "drop")
TailShape = Literal["lognormal", "heavy"]
# natural lengths: tail -> (median length / max_new_tokens, share of draws at or beyond max_new_tokens)
TAILS: dict[str, tuple[float, float]] = {"lognormal": (0.25, 0.03), "heavy": (0.125, 0.10)}


def tail_sigma(tail: str) -> float:
    """The lognormal sigma with P(X >= max) = the tail's capped share when the median is its fraction of max."""
    median, capped = TAILS[tail]
    return math.log(1 / median) / statistics.NormalDist().inv_cdf(1 - capped)


MATRIX_SEQS = (128, 512, 2048)
MATRIX_NEW_TOKENS = (256, 1024, 4096)
MATRIX_SAMPLES = 8
MATRIX_PROMPT_LEN = 256
# (student, teacher) sizes of the distillation cases; the tokenizer is one per vocabulary size, so a
# pair shares it when the two shapes' vocab_size agree (7b's differs from the others').
DISTILL_PAIRS: tuple[tuple[str, str], ...] = (("0.5b", "1.5b"),)
TINY_DISTILL_PAIRS: tuple[tuple[str, str], ...] = (("tiny", "tiny2"),)


@dataclasses.dataclass(kw_only=True, frozen=True)
class Workload:
    """One case's rollout and update. ``size``: a key of :data:`~bench.grpo.shapes.SHAPES`;
    ``prompts`` x ``samples`` sequences (GRPO groups of ``samples``), each prompt exactly
    ``prompt_len`` tokens; completions of at most ``max_new_tokens`` in ``lengths`` mode; ``kl``: a
    reference model and a KL loss (coefficient 0.04, k3) in both frameworks; ``rollout``: ``plain``
    or a long-tail mode of ``rollout.partial`` (``carry``, ``drop``: natural lengths only), recorded
    as ``partial_rollout`` (not plain) and ``rollout_mode``. ``teacher``: None, or the size (a key
    of :data:`~bench.grpo.shapes.SHAPES`, same ``vocab_size`` as ``size``: the same tokenizer) of a
    local teacher that scores the student's tokens (on-policy distillation, Tidal only)."""

    size: str
    prompts: int
    samples: int
    prompt_len: int
    max_new_tokens: int
    lengths: LengthMode = "forced"
    kl: bool = False
    rollout: RolloutMode = "plain"
    teacher: str | None = None
    tail: TailShape = "lognormal"

    def __post_init__(self):
        if self.size not in SHAPES:
            raise ValueError(f"size: unknown {self.size!r}; known: {sorted(SHAPES)}")
        if self.teacher is not None:
            if self.teacher not in SHAPES:
                raise ValueError(f"teacher: unknown {self.teacher!r}; known: {sorted(SHAPES)}")
            if SHAPES[self.teacher]["vocab_size"] != SHAPES[self.size]["vocab_size"]:
                raise ValueError(f"teacher: {self.teacher} has another vocabulary than the {self.size} student "
                                 f"({SHAPES[self.teacher]['vocab_size']} vs {SHAPES[self.size]['vocab_size']}): "
                                 "distillation needs one tokenizer")
        for name in ("prompts", "prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2 (GRPO groups), got {self.samples}")
        if self.lengths not in LENGTH_MODES:
            raise ValueError(f"lengths must be one of {LENGTH_MODES}, got {self.lengths!r}")
        if self.rollout not in ROLLOUT_MODES:
            raise ValueError(f"rollout must be one of {ROLLOUT_MODES}, got {self.rollout!r}")
        if self.tail not in TAILS:
            raise ValueError(f"tail must be one of {sorted(TAILS)}, got {self.tail!r}")
        if self.tail != "lognormal" and self.lengths != "natural":
            raise ValueError(f"tail={self.tail!r} shapes natural lengths; forced ones are all max_new_tokens")
        if self.rollout != "plain" and self.lengths != "natural":
            raise ValueError(f"rollout={self.rollout!r} needs natural lengths: with forced ones every sequence ends at the same step")
        for size in filter(None, (self.size, self.teacher)):
            if self.prompt_len + self.max_new_tokens > SHAPES[size]["max_position_embeddings"]:
                raise ValueError(f"prompt_len + max_new_tokens ({self.prompt_len + self.max_new_tokens}) exceeds the "
                                 f"{size} model's max_position_embeddings")

    @property
    def seqs(self) -> int:
        return self.prompts * self.samples

    @property
    def partial_rollout(self) -> bool:
        return self.rollout != "plain"

    @property
    def name(self) -> str:
        mode = "" if self.rollout == "plain" else f"-{self.rollout}"
        shape = ("" if self.tail == "lognormal" else f"-{self.tail}") + (f"-g{self.samples}" if self.samples > MATRIX_SAMPLES else "")
        return (f"{self.size}-{self.seqs}x{self.max_new_tokens}-{self.lengths}{shape}{mode}" + ("-kl" if self.kl else "")
                + (f"-distill{self.teacher}" if self.teacher else ""))

    def completion_lengths(self, rollout: int, seed: int, count: int | None = None) -> list[int]:
        """The completion lengths of rollout ``rollout`` (0-based), prompt-major: ``count``
        sequences (default ``seqs``; a long-tail rollout starts as many as it has free slots)."""
        count = self.seqs if count is None else count
        if self.lengths == "forced":
            return [self.max_new_tokens] * count
        return natural_lengths(count, self.max_new_tokens, seed=seed, rollout=rollout, tail=self.tail)


def natural_lengths(n: int, max_new_tokens: int, *, seed: int, rollout: int, tail: str = "lognormal") -> list[int]:
    """``n`` lengths in ``1..max_new_tokens``: ceil of a lognormal draw whose median is the tail's
    fraction of ``max_new_tokens`` (:data:`TAILS`) and sigma :func:`tail_sigma` (so about the tail's
    capped share reach the maximum), from a generator seeded with ``(seed, rollout)`` only."""
    rng = np.random.default_rng([seed, rollout])
    x = rng.lognormal(mean=math.log(TAILS[tail][0] * max_new_tokens), sigma=tail_sigma(tail), size=n)
    return np.clip(np.ceil(x), 1, max_new_tokens).astype(int).tolist()


def matrix(sizes: list[str] | None = None, *, samples: int = MATRIX_SAMPLES, prompt_len: int = MATRIX_PROMPT_LEN,
           seqs: tuple[int, ...] = MATRIX_SEQS, new_tokens: tuple[int, ...] = MATRIX_NEW_TOKENS,
           distill: tuple[tuple[str, str], ...] | None = None) -> list[Workload]:
    """Every (size, sequences, new tokens, length mode) case, on natural lengths every rollout mode,
    and the plain cases again for each (student, teacher) pair of ``distill`` (default
    :data:`DISTILL_PAIRS`, those whose student is among ``sizes``); cheapest first within each
    student size (plain, carry, drop next to each other), a plain case before its distillation ones."""
    sizes = sizes or SIZE_ORDER
    pairs = [(z, None) for z in sizes] + [p for p in (DISTILL_PAIRS if distill is None else distill) if p[0] in sizes]
    out = []
    for size, teacher in pairs:
        for s in seqs:
            for r in new_tokens:
                for mode in LENGTH_MODES:
                    for rollout in (ROLLOUT_MODES if mode == "natural" and teacher is None else ("plain",)):
                        out.append(Workload(size=size, prompts=s // samples, samples=samples, prompt_len=prompt_len,
                                            max_new_tokens=r, lengths=mode, rollout=rollout, teacher=teacher))
    return sorted(out, key=lambda w: (SIZE_ORDER.index(w.size) if w.size in SIZE_ORDER else -1,
                                      w.seqs * (w.prompt_len + w.max_new_tokens), w.teacher is not None, w.teacher or "",
                                      w.lengths, ROLLOUT_MODES.index(w.rollout)))


LONG_TAIL_SIZES = ("0.5b", "1.5b", "7b")
LONG_TAIL_SEQS = (128, 512)
LONG_TAIL_NEW_TOKENS = (2048, 8192, 16384)
LONG_TAIL_GROUPS = (8, 16)


def long_tail_matrix(sizes: tuple[str, ...] = LONG_TAIL_SIZES, *, seqs: tuple[int, ...] = LONG_TAIL_SEQS,
                     new_tokens: tuple[int, ...] = LONG_TAIL_NEW_TOKENS, groups: tuple[int, ...] = LONG_TAIL_GROUPS,
                     prompt_len: int = MATRIX_PROMPT_LEN) -> list[Workload]:
    """Reasoning-shaped rollouts (issue 30): natural lengths with both tails, groups of 8 and 16,
    plain, carry and drop next to each other; cheapest first within each size."""
    out = [Workload(size=z, prompts=s // g, samples=g, prompt_len=prompt_len, max_new_tokens=r, lengths="natural",
                    tail=t, rollout=mode)
           for z in sizes for s in seqs for r in new_tokens for g in groups for t in TAILS for mode in ROLLOUT_MODES
           if prompt_len + r <= SHAPES[z]["max_position_embeddings"]]
    return sorted(out, key=lambda w: (sizes.index(w.size), w.seqs * w.max_new_tokens, w.samples, w.tail,
                                      ROLLOUT_MODES.index(w.rollout)))


def tiny_matrix() -> list[Workload]:
    """The CPU matrix: the tiny model, 2 prompts x 2 samples, 8 prompt tokens, 8 or 16 new tokens,
    both length modes; and one distillation case (8 new tokens, natural lengths, teacher ``tiny2``)."""
    plain = matrix(["tiny"], samples=2, prompt_len=8, seqs=(4,), new_tokens=(8, 16), distill=())
    distill = matrix(["tiny"], samples=2, prompt_len=8, seqs=(4,), new_tokens=(8,), distill=TINY_DISTILL_PAIRS)
    return plain + [w for w in distill if w.teacher is not None and w.lengths == "natural"]


# The GPU check of every family (issue 50 item 2): 32 prompts x 8 samples, 256 prompt tokens, 512 new
# tokens forced, each family's shape (:data:`~bench.grpo.shapes.FAMILY_SHAPES`) and the dense 0.5B
# baseline; two GRPO iterations each (``matrix --families``: one warm-up, one timed).
FAMILY_CASE = dict(prompts=32, samples=8, prompt_len=256, max_new_tokens=512, lengths="forced")


def family_matrix() -> list[Workload]:
    """One case per family shape plus the dense Qwen2.5-0.5B baseline (the mismatch reference)."""
    return [Workload(size=size, **FAMILY_CASE) for size in ["0.5b", *FAMILY_SHAPES]]


def select(workloads: list[Workload], patterns: list[str], *, option: str = "--cases") -> list[Workload]:
    """The workloads whose name matches one of the shell-style ``patterns`` (all when none), in
    matrix order. A pattern that matches nothing is an error naming ``option`` and the known cases."""
    if not patterns:
        return list(workloads)
    for p in patterns:
        if not any(fnmatch.fnmatchcase(w.name, p) for w in workloads):
            example = workloads[0].name if workloads else "0.5b-512x1024-natural"
            raise ValueError(f"{option}: {p!r} matches no case; cases are named SIZE-SEQSxNEW-LENGTHS[-carry|-drop][-distillTEACHER], "
                             f"e.g. {example}; known: {', '.join(w.name for w in workloads) or 'none'}")
    return [w for w in workloads if any(fnmatch.fnmatchcase(w.name, p) for p in patterns)]
