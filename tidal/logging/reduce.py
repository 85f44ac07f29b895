"""How a metric is combined over ranks and over the steps of a logging window: by its name.

The naming contract (every metric a rank reports follows it; the last path segment decides):

| name | over ranks | over the steps of a ``logging.log_every`` window |
| --- | --- | --- |
| ``.../count`` or ``..._count`` (a number of things) | sum | mean (per step) |
| ``..._max`` | max | max |
| ``..._min`` | min | min |
| ``K`` beside ``K/count`` (a mean over a per-rank number of items) | mean weighted by ``K/count`` (NaN where no rank counted any) | mean |
| anything else (a mean, a fraction ``_frac``, seconds) | mean | mean |

So ``reward/dropped_count`` is the number of samples dropped on all ranks together,
``response/length_max`` the longest response of any rank, and ``reward/correct`` the mean over
every rank's scored samples however they were spread. Every rank must pass the same keys to
:func:`reduce_over_ranks`; where ranks may report different keys (an environment's counters), the
caller takes their union and fills what a rank lacks with :func:`with_absent`: a key a rank did not
report counts as nothing there (0 in sums and means, no candidate for an extreme).
"""

from __future__ import annotations

import math
from typing import Callable, Literal

Reduction = Literal["sum", "max", "min", "weighted", "mean"]
AllReduce = Callable[[list[float]], list[float]]


def is_count(key: str) -> bool:
    last = key.rpartition("/")[2]
    return last == "count" or last.endswith("_count")


def reduction(key: str, keys) -> Reduction:
    """How ``key`` combines over ranks, given all the keys reported with it (see the module table)."""
    last = key.rpartition("/")[2]
    if is_count(key):
        return "sum"
    if last.endswith("_max"):
        return "max"
    if last.endswith("_min"):
        return "min"
    if f"{key}/count" in keys:
        return "weighted"
    return "mean"


def with_absent(metrics: dict[str, float], keys) -> dict[str, float]:
    """``metrics`` with every key of ``keys`` it lacks added as "nothing" for its reduction: 0 for
    sums, means and weighted means (their count is 0 too), -inf for ``_max`` and +inf for ``_min``
    (never the extreme while any rank reported the key)."""
    out = dict(metrics)
    for k in keys:
        if k not in out:
            how = reduction(k, keys)
            out[k] = -math.inf if how == "max" else math.inf if how == "min" else 0.0
    return out


def reduce_over_ranks(metrics: dict[str, float], *, world_size: int, all_reduce_sum: AllReduce,
                      all_reduce_max: AllReduce) -> dict[str, float]:
    """``metrics`` of this rank combined with every other rank's by the naming contract (collective:
    every rank calls it with the same keys). Two sum-reductions and one max-reduction at most."""
    keys = sorted(metrics)
    how = {k: reduction(k, metrics) for k in keys}
    out: dict[str, float] = {}
    sums = [k for k in keys if how[k] in ("sum", "mean", "weighted")]
    local = []
    for k in sums:
        v = metrics[k]
        if how[k] == "weighted":  # sum of value x count; a rank that counted nothing adds nothing (its NaN too)
            count = metrics[f"{k}/count"]
            v = v * count if count else 0.0
        local.append(v)
    totals = dict(zip(sums, all_reduce_sum(local))) if sums else {}
    extremes = [k for k in keys if how[k] in ("max", "min")]
    if extremes:
        signed = [metrics[k] if how[k] == "max" else -metrics[k] for k in extremes]
        for k, v in zip(extremes, all_reduce_max(signed)):
            out[k] = v if how[k] == "max" else -v
    for k in sums:
        if how[k] == "sum":
            out[k] = totals[k]
        elif how[k] == "mean":
            out[k] = totals[k] / world_size
    for k in sums:
        if how[k] == "weighted":
            count = totals[f"{k}/count"]
            out[k] = totals[k] / count if count else math.nan
    return {k: out[k] for k in keys}


def combine_steps(key: str, values: list[float]) -> float:
    """One logged value of ``key`` from its values over the steps of a logging window."""
    last = key.rpartition("/")[2]
    if last.endswith("_max"):
        return max(values)
    if last.endswith("_min"):
        return min(values)
    return sum(values) / len(values)
