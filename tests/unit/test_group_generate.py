"""GroupGenerator's merge of a round's batches (every TP rank derives the same engine calls from the
same gathered list) and its lone-rank round; the 2-rank lockstep run is
tests/integration/test_env_tp_lockstep.py."""

import pytest

from tidal.distributed.generate import GenerateBatch, GroupGenerator, merge_batches
from tidal.engine.base import Completion, SamplingParams

from tests.runtimes import lone_runtime


def test_batches_that_differ_only_in_their_seed_share_one_call_in_rank_order():
    a, a_other_seed = SamplingParams(max_new_tokens=8, n=4, seed=1), SamplingParams(max_new_tokens=8, n=4, seed=2)
    short, one = SamplingParams(max_new_tokens=3, n=1, seed=7), SamplingParams(max_new_tokens=8, n=1, seed=9)
    per_rank = [
        [([[1]], a, None, None, None), ([[2], [3]], short, None, None, None)],   # rank 0
        [],                                                                    # rank 1: nothing ready this round
        [([[4]], one, None, None, None), ([[5]], a_other_seed, [{"pix": 1}], [2, 8, 8, 8], None)],  # rank 2
    ]
    calls = merge_batches(per_rank)
    assert [params for params, _ in calls] == [a, short, one]  # first appearance; the first batch's seed
    assert [[(r, j, p) for r, j, p, *_ in owners] for _, owners in calls] == [
        [(0, 0, [[1]]), (2, 1, [[5]])], [(0, 1, [[2], [3]])], [(2, 0, [[4]])]]


def test_a_lone_rank_calls_the_engine_once_per_batch():
    seen = []

    class Engine:
        def generate(self, prompts, params, **kw):
            seen.append((prompts, params.n, "mm_inputs" in kw))
            return [Completion(prompt_ids=p, token_ids=[1], logprobs=[0.0], finish_reason="stop") for p in prompts for _ in range(params.n)]

    gen = GroupGenerator(Engine(), lone_runtime())
    assert gen.poll_s is None
    out = gen.round([GenerateBatch(prompts=[[1], [2]], params=SamplingParams(n=2)),
                     GenerateBatch(prompts=[[3]], params=SamplingParams(), mm_inputs=[{"pix": 1}])], busy=True)
    assert [len(c) for c in out.completions] == [4, 1] and out.group_busy
    assert seen == [([[1], [2]], 2, False), ([[3]], 1, True)]
    assert not gen.round([], busy=False).group_busy and len(seen) == 2  # no batch, no engine call


def test_a_merged_call_keeps_each_ranks_stream_keys_in_rank_order():
    from tidal.distributed.generate import _merged_keys

    owners = [(0, 0, [[1]], None, None, [5, 6]), (1, 0, [[2], [3]], None, None, [7, 8, 9, 10])]
    assert _merged_keys(owners) == [5, 6, 7, 8, 9, 10]
    assert _merged_keys([o[:5] + (None,) for o in owners]) is None
    with pytest.raises(ValueError, match="stream keys"):  # positions in the merged call could meet another's keys
        _merged_keys([owners[0], owners[1][:5] + (None,)])
