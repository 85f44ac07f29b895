"""What every reward component implements, and what it hands back to the engine."""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from typing import Any

import torch

from tidal.rewards.types import RewardSample


class RewardError(RuntimeError):
    """A reward could not be computed (the step stops unless ``reward.on_error: drop`` applies)."""


@dataclasses.dataclass(kw_only=True)
class ComponentResult:
    """Scores of the n samples a component was given, in order.

    scores: one float per sample (NaN where ``errors`` has an entry).
    errors: position in the given list -> why that sample has no score.
    counters: event counts to report as ``reward/<component>/<counter>`` (timeouts, retries, ...).
    """

    scores: list[float]
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def failed(cls, n: int, message: str, **counters: float) -> "ComponentResult":
        return cls(scores=[math.nan] * n, errors={i: message for i in range(n)}, counters=dict(counters))


def as_score(value: Any) -> float:
    """``value`` as a finite float; raises ValueError/TypeError saying what was wrong with it."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"returned a tensor of shape {tuple(value.shape)}, expected one number")
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, expected a finite number")
    return out


class SyncComponent(abc.ABC):
    """A component computed on the calling thread (rules, local models).

    counter_names: the counters its results always carry (reported as 0 when it did not run).
    scores_every_sample: if True the engine passes it every sample of each ``score`` call, whether
    or not their recipes use it, so that its work (forward passes) is the same on every rank."""

    scores_every_sample: bool = False
    counter_names: tuple[str, ...] = ()

    @abc.abstractmethod
    def score(self, samples: list[RewardSample]) -> ComponentResult: ...

    def close(self) -> None:
        pass


class AsyncComponent(abc.ABC):
    """A component computed on the engine's event loop (functions, remote services).
    counter_names: the counters its results always carry (reported as 0 when it did not run)."""

    counter_names: tuple[str, ...] = ()

    @abc.abstractmethod
    async def score_async(self, samples: list[RewardSample]) -> ComponentResult: ...

    async def aclose(self) -> None:
        pass
