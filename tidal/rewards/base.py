"""What every reward component implements, and what it hands back to the engine."""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import sys
from typing import Any

from tidal.rewards.types import RewardSample

# The largest finite float32: scores are stored as float32, so a larger one (1e39) would become inf.
FLOAT32_MAX = 3.4028234663852886e38


MAX_ERROR_CHARS = 2000  # of one sample's error message: kept in memory per sample, printed in one line


def cut_message(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` (a reward's error message) cut to about ``limit`` characters: its
    start and its end, with how much was cut between them. A function that raises with a 50 MB
    message (a whole response, a log) made a 52 MB log line, and a copy of it per failed sample."""
    if len(text) > limit:
        head, tail = text[: limit * 3 // 4], text[-(limit // 4):]
        text = f"{head} [... {len(text) - len(head) - len(tail):,} characters cut ...] {tail}"
    return text


class RewardError(RuntimeError):
    """A reward could not be computed (the step stops unless ``reward.on_error: drop`` applies)."""


@dataclasses.dataclass(kw_only=True)
class ComponentResult:
    """Scores of the n samples a component was given, in order.

    scores: one float per sample (NaN where ``errors`` has an entry).
    errors: position in the given list -> why that sample has no score.
    counters: event counts to report as ``reward/<component>/<counter>`` (timeouts, retries, ...).
    unparsed: positions whose response held no answer the component could read (scored as wrong
        answers), for a component that reads answers (a rule with ``reads_answers``); None for one
        that does not say.
    """

    scores: list[float]
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    unparsed: set[int] | None = None

    @classmethod
    def failed(cls, n: int, message: str, **counters: float) -> "ComponentResult":
        return cls(scores=[math.nan] * n, errors={i: message for i in range(n)}, counters=dict(counters))


def score_problem(value: float) -> str | None:
    """Why the float ``value`` is not a usable score (None when it is): not finite, or beyond float32's
    range, where it would be stored as inf (a reward of 1e39 is as invalid as NaN)."""
    if not math.isfinite(value):
        return f"{value}, expected a finite number"
    if abs(value) > FLOAT32_MAX:
        return f"{value:g}, beyond float32's range (|score| <= 3.4e38): it would be stored as inf"
    return None


def as_score(value: Any) -> float:
    """``value`` as a finite float32-representable float; raises ValueError/TypeError saying what was
    wrong with it. Needs no torch import (a tensor can only come from code that imported torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"returned a tensor of shape {tuple(value.shape)}, expected one number")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number")
    try:
        out = float(value)
    except (OverflowError, ValueError) as e:  # e.g. an int beyond float's range
        raise ValueError(f"returned {value!r:.40}, which is not a float ({e})") from None
    problem = score_problem(out)
    if problem is not None:
        raise ValueError(f"returned {problem}")
    return out


class SyncComponent(abc.ABC):
    """A component computed on the calling thread (rules, local models).

    counter_names: the counters its results always carry (reported as 0 when it did not run).
    scores_every_sample: if True the engine passes it every sample of each ``score`` call, whether
    or not their recipes use it, so that its work (forward passes) is the same on every rank.
    reads_answers: its results say which responses it could not read (``ComponentResult.unparsed``),
    reported as ``reward/<name>/unparsed_frac``."""

    scores_every_sample: bool = False
    counter_names: tuple[str, ...] = ()
    streams: bool = False  # scores each sample on its own, cheaply on the host: may score a batch in pieces
    reads_answers: bool = False

    @abc.abstractmethod
    def score(self, samples: list[RewardSample]) -> ComponentResult: ...

    def close(self) -> None:
        pass


class AsyncComponent(abc.ABC):
    """A component computed on the engine's event loop (functions, remote services).
    counter_names: the counters its results always carry (reported as 0 when it did not run).
    streams: scores each sample on its own, so a batch may be scored in pieces (a batched function
    does not)."""

    counter_names: tuple[str, ...] = ()
    streams: bool = True

    @abc.abstractmethod
    async def score_async(self, samples: list[RewardSample]) -> ComponentResult: ...

    @abc.abstractmethod
    def deadline_s(self, n: int) -> float:
        """The longest ``score_async`` of n samples can take while the component keeps its own
        limits (per-call timeouts, concurrency, retries): what ``reward.timeout_s: null`` derives from."""

    def detach_loop(self) -> None:
        """Forget what is bound to the engine's event loop (e.g. an HTTP session): the engine gave
        that loop up (it stopped answering) and runs the next calls on a new one."""

    def needs_close(self) -> bool:
        """True while it holds something that ``aclose`` must release even if the event loop it
        was used on has been given up (worker processes)."""
        return False

    async def aclose(self) -> None:
        pass
