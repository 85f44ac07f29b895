"""The reduction contract of tidal.logging.reduce: counts summed over ranks, extremes, weighted means."""

import math

import pytest

from tidal.logging.reduce import combine_steps, reduce_over_ranks, reduction, with_absent


class Ranks:
    """all_reduce over fake ranks: each call gets every rank's list in turn."""

    def __init__(self, per_rank: list[dict]):
        self.per_rank = per_rank

    def run(self):
        calls: list[list[list[float]]] = []

        def collective(op):
            def f(values):
                calls.append(values)
                i = len(calls) - 1
                return [op(col) for col in zip(*all_values[i])]
            return f

        # every rank makes the same calls in the same order: record them rank by rank, then answer
        all_values: list[list[list[float]]] = []
        outs = []
        for metrics in self.per_rank:
            log: list[list[float]] = []
            reduce_over_ranks(metrics, world_size=len(self.per_rank), all_reduce_sum=lambda v: log.append(v) or v,
                              all_reduce_max=lambda v: log.append(v) or v)
            for j, v in enumerate(log):
                if len(all_values) <= j:
                    all_values.append([])
                all_values[j].append(v)
        for metrics in self.per_rank:
            calls.clear()
            outs.append(reduce_over_ranks(metrics, world_size=len(self.per_rank), all_reduce_sum=collective(sum),
                                          all_reduce_max=collective(max)))
        return outs


def test_the_naming_contract():
    keys = {"reward/correct", "reward/correct/count"}
    assert [reduction(k, keys) for k in ("reward/dropped_count", "reward/correct/count", "response/length_max",
                                         "x/y_min", "reward/correct", "reward/mean", "time/generate")] == [
        "sum", "sum", "max", "min", "weighted", "mean", "mean"]


def test_counts_summed_extremes_and_weighted_means_over_ranks():
    rank0 = {"reward/dropped_count": 2.0, "response/length_max": 10.0, "response/length_min": 3.0, "reward/mean": 0.2,
             "reward/correct": 1.0, "reward/correct/count": 1.0, "reward/fmt": math.nan, "reward/fmt/count": 0.0}
    rank1 = {"reward/dropped_count": 3.0, "response/length_max": 7.0, "response/length_min": 1.0, "reward/mean": 0.6,
             "reward/correct": 0.25, "reward/correct/count": 4.0, "reward/fmt": math.nan, "reward/fmt/count": 0.0}
    out0, out1 = Ranks([rank0, rank1]).run()
    assert out0.keys() == out1.keys() == rank0.keys()
    assert out0["reward/dropped_count"] == 5.0 and out0["reward/correct/count"] == 5.0  # summed, not averaged
    assert out0["response/length_max"] == 10.0 and out0["response/length_min"] == 1.0
    assert out0["reward/mean"] == pytest.approx(0.4)
    assert out0["reward/correct"] == pytest.approx((1.0 + 4 * 0.25) / 5)  # weighted by its count
    assert math.isnan(out0["reward/fmt"]) and out0 == pytest.approx(out1, nan_ok=True)


def test_combine_steps():
    assert combine_steps("response/length_max", [3.0, 9.0, 4.0]) == 9.0
    assert combine_steps("x_min", [3.0, 9.0]) == 3.0
    assert combine_steps("reward/dropped_count", [2.0, 4.0]) == 3.0  # per step


def test_keys_one_rank_lacks_count_as_nothing_there():
    rank0 = {"env/tool_calls": 2.0, "env/tool_calls_count": 4.0, "response/length_max": 5.0, "x_min": 2.0,
             "reward/correct": 0.5, "reward/correct/count": 2.0}
    rank1 = {"response/length_max": 3.0}
    keys = sorted(set(rank0) | set(rank1))
    out0, out1 = Ranks([with_absent(rank0, keys), with_absent(rank1, keys)]).run()
    assert out0 == out1
    assert out0["env/tool_calls"] == 1.0 and out0["env/tool_calls_count"] == 4.0  # a mean over both ranks, a sum
    assert out0["response/length_max"] == 5.0 and out0["x_min"] == 2.0  # rank 1 offers no extreme
    assert out0["reward/correct"] == 0.5  # rank 1 counted none: it weighs nothing
