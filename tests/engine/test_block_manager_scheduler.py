"""Block manager and scheduler bookkeeping, with hand-computed expectations (no model involved)."""

import pytest

from tidal.engine.native.block_manager import BlockManager
from tidal.engine.native.scheduler import Scheduler
from tidal.engine.native.sequence import Sequence, SequenceStatus


def seq(i, tokens, max_tokens=8):
    return Sequence(i, tokens, max_tokens)


def test_prefix_blocks_are_shared_and_refcounted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(0, list(range(10)))  # blocks [0-3][4-7][8-9]
    assert bm.can_allocate(a) == []
    bm.allocate(a, [])
    bm.register_computed(a, 10)  # two full blocks registered
    b = seq(1, list(range(9)))  # same first 8 tokens; last block holds token 8 -> 2 hits
    hits = bm.can_allocate(b)
    assert [bid for _, bid in hits] == a.block_table[:2]
    bm.allocate(b, hits)
    assert b.num_cached_tokens == 8 and bm.num_hit_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1] and bm.num_free_blocks == 5


def test_freed_prefix_still_hits_until_its_block_is_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq(0, [5, 6, 7])
    bm.allocate(a, bm.can_allocate(a))
    bm.register_computed(a, 3)
    bm.deallocate(a)
    again = seq(1, [5, 6, 9])
    assert len(bm.can_allocate(again)) == 1  # block [5, 6] is free but still cached
    # allocating 3 fresh blocks walks the free list (least recently freed first) and evicts it
    c = seq(2, [1, 2, 3, 4, 5])
    bm.allocate(c, bm.can_allocate(c))
    bm.register_computed(c, 5)
    bm.deallocate(c)
    assert bm.can_allocate(again) == []


def test_can_allocate_counts_cached_free_blocks_and_refuses_when_full():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq(0, [1, 2, 3])
    bm.allocate(a, bm.can_allocate(a))
    assert bm.can_allocate(seq(1, [8, 9, 10])) is None  # needs 2 blocks, 0 free
    bm.register_computed(a, 3)
    b = seq(2, [1, 2, 4])  # shares block [1, 2] with a (held): needs 1 new block, 0 free
    assert bm.can_allocate(b) is None
    bm.deallocate(a)
    assert len(bm.can_allocate(b)) == 1


def test_reset_prefix_cache_forgets_hashes():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq(0, [1, 2, 3])
    bm.allocate(a, bm.can_allocate(a))
    bm.register_computed(a, 3)
    with pytest.raises(RuntimeError):
        bm.reset_prefix_cache()
    bm.deallocate(a)
    bm.reset_prefix_cache()
    assert bm.can_allocate(seq(1, [1, 2, 3])) == []


def _step(sched, token=1):
    batch = sched.schedule()
    n = sum(batch.sampling)
    sched.postprocess(batch, [token] * n, [0.0] * n, frozenset())
    return batch


def test_scheduler_preempts_latest_when_blocks_run_out():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(0, [1, 2, 3, 4], max_tokens=5), seq(1, [5, 6, 7, 8], max_tokens=5)
    sched.add(a)
    sched.add(b)
    batch = _step(sched)  # both prefilled (one block each) and sampled one token
    assert batch.is_prefill and batch.seqs == [a, b] and len(a) == len(b) == 5
    batch = _step(sched)  # decode: each needs a 2nd block, 1 free: a takes it, b (last running) is preempted
    assert not batch.is_prefill and batch.seqs == [a]
    assert sched.num_preemptions == 1 and b.status is SequenceStatus.WAITING and b.block_table == []
    assert list(sched.waiting) == [b] and len(b) == 5 and bm.num_free_blocks == 1
    # b cannot be re-admitted (needs 2 blocks) until a finishes: a decodes alone
    while a.status is not SequenceStatus.FINISHED:
        batch = _step(sched)
        assert batch.seqs == [a]
    assert a.finish_reason == "length" and a.num_completion_tokens == 5
    # b comes back: its freed first block [5, 6, 7, 8] is still cached, so only token 5 is recomputed
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [b] and batch.num_tokens == 1 and batch.sampling == [True]
    assert bm.num_hit_tokens == 4
    sched.postprocess(batch, [2], [-0.5], frozenset())
    assert b.completion_ids == [1, 2] and b.logprobs == [0.0, -0.5]


def test_chunked_prefill_over_the_token_budget():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=5)
    a, b = seq(0, list(range(7)), max_tokens=2), seq(1, [9, 9], max_tokens=2)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [a] and a.num_scheduled_tokens == 5 and first.sampling == [False]
    sched.postprocess(first, [], [], frozenset())
    second = sched.schedule()
    assert second.seqs == [a, b] and [s.num_scheduled_tokens for s in second.seqs] == [2, 2]
    assert second.sampling == [True, True]


def test_scheduler_respects_max_num_seqs_and_rejects_oversized():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(seq(i, [i + 1], max_tokens=3))
    assert [s.seq_id for s in sched.schedule().seqs] == [0, 1]
    with pytest.raises(ValueError, match="needs more KV blocks"):
        sched.add(seq(9, [1] * 60, max_tokens=8))


def test_schedule_ahead_runs_one_token_past_and_voids_stopped_rows():
    bm = BlockManager(num_blocks=6, block_size=2)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = seq(0, [1, 2], max_tokens=8), seq(1, [3], max_tokens=8), seq(2, [4, 5, 6], max_tokens=2)
    for s in (a, b, c):
        sched.add(s)
    assert sched.schedule_ahead(_step(sched)) is None  # never after a prefill
    batch = sched.schedule()  # decode: lengths 3, 2, 4
    ahead = sched.schedule_ahead(batch)
    # c reaches max_tokens with this step's token: not ahead; a needs a block for its 4th token
    assert ahead.seqs == [a, b] and ahead.src_rows == [0, 1] and len(a.block_table) == 2
    sched.postprocess(batch, [7, 9, 7], [0.0] * 3, frozenset({9}))  # b stops, c hits its length
    sched.commit_ahead(ahead)
    assert b.finish_reason == "stop" and c.finish_reason == "length" and list(sched.running) == [a]
    assert a.num_scheduled_tokens == 1 and b.num_scheduled_tokens == 0
    sched.postprocess(ahead, [8, 5], [0.0] * 2, frozenset({9}))  # b's row is void: its token is dropped
    assert a.completion_ids == [1, 7, 8] and b.completion_ids == [1, 9]
    sched.add(seq(3, [1]))
    assert sched.schedule_ahead(sched.schedule()) is None  # a sequence waits: prefill comes first
