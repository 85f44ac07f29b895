"""Block manager and scheduler bookkeeping, with hand-computed expectations (no model involved)."""

import numpy as np
import pytest

from tidal.engine.native.block_manager import (
    BlockManager,
    FreeQueue,
    block_digests,
    chain_hashes,
    chain_one,
    prefix_hashes,
)
from tidal.engine.native.scheduler import Scheduler
from tidal.engine.native.sequence import Sequence, SequenceTable, Status


def _allocate(bm, tokens, num_blocks):
    """lookup + allocate + register the full blocks, as the scheduler does for a prompt."""
    tokens = np.asarray(tokens, dtype=np.int32)
    _, hits = bm.lookup(tokens, 0)
    assert bm.can_allocate(num_blocks, hits)
    ids = bm.allocate(num_blocks, hits)
    full = len(tokens) // bm.block_size
    blocks = tokens[: full * bm.block_size].reshape(full, bm.block_size)
    bm.register(ids[len(hits):full], prefix_hashes(blocks, 0)[len(hits):], blocks[len(hits):])
    return ids, hits


def test_chain_hash_on_ints_equals_the_vectorized_one():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 150_000, (5, 16)).astype(np.int32)
    prev = rng.integers(0, 2**63, 5).astype(np.uint64) * np.uint64(2) + np.uint64(1)  # above 2**63 too
    vec = chain_hashes(prev, block_digests(blocks)).tolist()
    assert vec == [chain_one(int(p), int(d)) for p, d in zip(prev, block_digests(blocks))]
    assert prefix_hashes(blocks, 7) == [h := chain_one(7, int(block_digests(blocks)[0]))] + prefix_hashes(blocks[1:], h)
    # one token changes every hash from its block on; the order of blocks matters
    other = blocks.copy()
    other[2, 5] += 1
    a, b = prefix_hashes(blocks, 0), prefix_hashes(other, 0)
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))
    assert prefix_hashes(blocks[::-1], 0)[-1] != a[-1]


def test_prefix_blocks_are_shared_and_refcounted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, hits = _allocate(bm, list(range(10)), 3)  # blocks [0-3][4-7][8-9]: two full ones registered
    assert hits == []
    hashes, hits = bm.lookup(np.arange(9, dtype=np.int32), 0)  # same first 8 tokens; last block holds token 8
    assert hits == a[:2].tolist() and hashes == prefix_hashes(np.arange(8, dtype=np.int32).reshape(2, 4), 0)
    b = bm.allocate(3, hits)
    assert bm.num_hit_tokens == 8 and b[:2].tolist() == a[:2].tolist() and b[2] != a[2]
    assert bm.ref_count[a].tolist() == [2, 2, 1] and bm.num_free_blocks == 8 - 4
    bm.release(a[::-1])
    assert bm.ref_count[b].tolist() == [1, 1, 1] and bm.num_free_blocks == 5


def test_a_hash_hit_must_hold_the_same_tokens():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, _ = _allocate(bm, [5, 6, 7], 2)
    h = prefix_hashes(np.array([[5, 6]], dtype=np.int32), 0)[0]
    bm.block_tokens[a[0]] = [5, 9]  # as if another block had collided on the hash
    assert bm.hash_to_block[h] == a[0] and bm.lookup(np.array([5, 6, 1], dtype=np.int32), 0) == ([], [])


def test_freed_prefix_still_hits_until_its_block_is_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, _ = _allocate(bm, [5, 6, 7], 2)
    bm.release(a[::-1])
    again = np.array([5, 6, 9], dtype=np.int32)
    assert len(bm.lookup(again, 0)[1]) == 1  # block [5, 6] is free but still cached
    # allocating 3 fresh blocks walks the free list (least recently freed first) and evicts it
    c, _ = _allocate(bm, [1, 2, 3, 4, 5], 3)
    bm.release(c[::-1])
    assert bm.lookup(again, 0) == ([], [])


def test_can_allocate_counts_cached_free_blocks_and_refuses_when_full():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, _ = _allocate(bm, [1, 2, 3], 2)
    assert not bm.can_allocate(2, [])  # needs 2 blocks, 0 free
    _, hits = bm.lookup(np.array([1, 2, 4], dtype=np.int32), 0)  # shares block [1, 2] with a (held)
    assert len(hits) == 1 and not bm.can_allocate(2, hits)  # needs 1 new block, 0 free
    bm.release(a[::-1])
    assert bm.can_allocate(2, hits)


def test_reset_prefix_cache_forgets_hashes():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, _ = _allocate(bm, [1, 2, 3], 2)
    with pytest.raises(RuntimeError):
        bm.reset_prefix_cache()
    bm.release(a)
    bm.reset_prefix_cache()
    assert bm.lookup(np.array([1, 2, 3], dtype=np.int32), 0) == ([], [])


def test_free_queue_takes_the_least_recently_freed_and_skips_blocks_taken_out_of_order():
    q = FreeQueue(6)
    assert q.pop(2).tolist() == [0, 1] and len(q) == 4
    q.remove(3)  # a prefix hit on a free block
    q.push(np.array([1, 0], dtype=np.int32))
    assert len(q) == 5 and q.pop(3).tolist() == [2, 4, 5]
    q.push(np.array([3], dtype=np.int32))  # freed again after the hit: a new entry, the old one void
    assert q.pop(3).tolist() == [1, 0, 3] and len(q) == 0
    for _ in range(50):  # the queue compacts itself as it fills
        q.push(np.arange(6, dtype=np.int32))
        assert sorted(q.pop(6).tolist()) == list(range(6))


def test_release_of_a_block_held_twice_frees_it_at_its_last_release():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, _ = _allocate(bm, [1, 2, 3], 2)
    b = bm.allocate(2, bm.lookup(np.array([1, 2, 4], dtype=np.int32), 0)[1])
    bm.release(np.concatenate([a[::-1], b[::-1]]))  # block a[0] is freed last
    # freed in order: a's last block, (a's first: still held by b), b's last block, b's first = a's first
    assert bm.num_free_blocks == 4 and bm.take(4).tolist() == [3, a[1], b[1], a[0]]


# ---- scheduler ----------------------------------------------------------------------------------
def _sched(num_blocks, block_size, max_num_seqs=8, max_num_batched_tokens=64):
    table = SequenceTable(block_size, capacity=2)  # grows as sequences come
    bm = BlockManager(num_blocks, block_size)
    return table, Scheduler(table, bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def _add(table, sched, i, tokens, max_tokens=8, stop=frozenset()):
    seq = Sequence(i, i, None, list(tokens), stop_set=sched.stop_set(stop))
    slot = table.add(seq, list(tokens), len(tokens) + max_tokens)
    sched.add(slot)
    return slot


def _step(sched, token=1):
    batch = sched.schedule()
    n = int(batch.sampling.sum()) if batch.is_prefill else len(batch.rows)
    finished = sched.postprocess(batch, np.full(n, token), np.zeros(n))
    for s in finished.tolist():
        sched.table.release(s)
    return batch


def _completion(table, slot):
    return table.token_list(slot, int(table.num_prompt[slot]))


def test_scheduler_preempts_latest_when_blocks_run_out():
    table, sched = _sched(num_blocks=3, block_size=4)
    a, b = _add(table, sched, 0, [1, 2, 3, 4], max_tokens=5), _add(table, sched, 1, [5, 6, 7, 8], max_tokens=5)
    batch = _step(sched)  # both prefilled (one block each) and sampled one token
    assert batch.is_prefill and batch.rows.tolist() == [a, b] and table.num_tokens[[a, b]].tolist() == [5, 5]
    batch = _step(sched)  # decode: each needs a 2nd block, 1 free: a takes it, b (last admitted) is preempted
    assert not batch.is_prefill and batch.rows.tolist() == [a]
    assert sched.num_preemptions == 1 and table.status[b] == Status.WAITING and table.num_blocks[b] == 0
    assert list(sched.waiting) == [b] and table.num_tokens[b] == 5 and sched.bm.num_free_blocks == 1
    # b cannot be re-admitted (needs 2 blocks) until a finishes: a decodes alone
    for _ in range(3):
        assert _step(sched).rows.tolist() == [a]
    assert table.status[a] == Status.FREE and table.gen[a] == 1  # finished (length) and released
    # b comes back: its freed first block [5, 6, 7, 8] is still cached, so only token 5 is recomputed
    batch = sched.schedule()
    assert batch.is_prefill and batch.rows.tolist() == [b] and batch.num_tokens == 1 and batch.sampling.tolist() == [True]
    assert sched.bm.num_hit_tokens == 4
    sched.postprocess(batch, np.array([2]), np.array([-0.5]))
    assert _completion(table, b) == [1, 2] and table.logprobs[b, 4:6].tolist() == [0.0, -0.5]


def test_preemption_frees_the_most_recent_until_the_rest_fits():
    table, sched = _sched(num_blocks=6, block_size=2)
    slots = [_add(table, sched, i, [i + 1, i + 2], max_tokens=6) for i in range(3)]  # one block each
    _step(sched)  # prefill: 3 blocks held, each sequence now 3 tokens long
    batch = _step(sched)  # decode: each needs a second block, 3 free
    assert batch.rows.tolist() == slots and sched.bm.num_free_blocks == 0
    _step(sched)  # the 4th token's KV fits the second block
    batch = _step(sched)  # each needs a third block, none free: preempting the last admitted frees two
    assert sched.num_preemptions == 1 and batch.rows.tolist() == slots[:2]
    assert list(sched.waiting) == [slots[2]] and table.num_tokens[slots[2]] == 5  # keeps its tokens


def test_chunked_prefill_over_the_token_budget():
    table, sched = _sched(num_blocks=8, block_size=4, max_num_batched_tokens=5)
    a, b = _add(table, sched, 0, list(range(7)), max_tokens=2), _add(table, sched, 1, [9, 9], max_tokens=2)
    first = sched.schedule()
    assert first.rows.tolist() == [a] and first.num_new.tolist() == [5] and first.sampling.tolist() == [False]
    assert sched.postprocess(first, np.zeros(0), np.zeros(0)).size == 0 and table.num_cached[a] == 5
    second = sched.schedule()
    assert second.rows.tolist() == [a, b] and second.num_new.tolist() == [2, 2]
    assert second.sampling.tolist() == [True, True]


def test_schedule_ahead_after_a_prefill_is_the_next_prefill():
    table, sched = _sched(num_blocks=8, block_size=4, max_num_batched_tokens=5)
    a, b = _add(table, sched, 0, list(range(7)), max_tokens=2), _add(table, sched, 1, [9, 9], max_tokens=2)
    first = sched.schedule()
    ahead = sched.schedule_ahead(first)  # before first's tokens are known: a's last two tokens, then b
    assert ahead.is_prefill and ahead.rows.tolist() == [a, b]
    assert ahead.start.tolist() == [5, 0] and ahead.num_new.tolist() == [2, 2] and table.num_cached[a] == 7
    sched.postprocess(first, np.zeros(0), np.zeros(0))
    # nothing waits: the decode of both, one token past their length, fed from ahead's samples
    decode = sched.schedule_ahead(ahead)
    assert not decode.is_prefill and decode.rows.tolist() == [a, b] and decode.src_rows.tolist() == [0, 1]
    sched.postprocess(ahead, np.array([4, 5]), np.zeros(2))
    assert _completion(table, a) == [4] and _completion(table, b) == [5]
    sched.postprocess(decode, np.array([6, 7]), np.zeros(2))
    assert _completion(table, a) == [4, 6] and _completion(table, b) == [5, 7]


def test_decode_after_a_prefill_feeds_known_tokens_from_the_host_and_new_ones_from_the_samples():
    table, sched = _sched(num_blocks=8, block_size=4)
    a = _add(table, sched, 0, [1, 2, 3], max_tokens=4)
    _step(sched, token=7)  # a prefilled and sampled: [1, 2, 3, 7]
    b = _add(table, sched, 1, [4, 5], max_tokens=4)
    c = _add(table, sched, 2, [6], max_tokens=1)  # finishes by length with its prefill's token
    prefill = sched.schedule()
    assert prefill.is_prefill and prefill.rows.tolist() == [b, c]
    decode = sched.schedule_ahead(prefill)
    # a: known input token (-1), one token at its length; b: the prefill's sample 0; c: left out
    assert decode.rows.tolist() == [a, b] and decode.src_rows.tolist() == [-1, 0]
    assert sched.schedule_ahead(decode) is None and sched.ahead_off == "not_in_step"  # c is still running
    sched.postprocess(prefill, np.array([8, 9]), np.zeros(2))
    sched.postprocess(decode, np.array([10, 11]), np.zeros(2))
    assert _completion(table, a) == [7, 10] and _completion(table, b) == [8, 11] and _completion(table, c) == [9]


def test_scheduler_respects_max_num_seqs_and_rejects_oversized():
    table, sched = _sched(num_blocks=16, block_size=4, max_num_seqs=2)
    for i in range(3):
        _add(table, sched, i, [i + 1], max_tokens=3)
    assert sched.schedule().rows.tolist() == [0, 1]
    with pytest.raises(ValueError, match="needs more KV blocks"):
        _add(table, sched, 9, [1] * 60, max_tokens=8)


def test_without_a_cap_every_sequence_that_fits_runs_in_one_batch():
    table, sched = _sched(num_blocks=64, block_size=4, max_num_seqs=None, max_num_batched_tokens=128)
    for i in range(40):
        _add(table, sched, i, [i + 1, 7], max_tokens=3)
    assert _step(sched).rows.tolist() == list(range(40))
    assert len(_step(sched).rows) == 40


def test_stop_sets_are_per_sequence():
    table, sched = _sched(num_blocks=8, block_size=4)
    a = _add(table, sched, 0, [1], max_tokens=4, stop=frozenset({5}))
    b = _add(table, sched, 1, [2], max_tokens=4, stop=frozenset({6}))
    batch = sched.schedule()
    finished = sched.postprocess(batch, np.array([5, 5]), np.zeros(2))
    assert finished.tolist() == [a] and table.finish[a] == 1 and table.status[b] == Status.RUNNING


def test_schedule_ahead_runs_one_token_past_and_voids_stopped_rows():
    table, sched = _sched(num_blocks=6, block_size=2)
    a = _add(table, sched, 0, [1, 2], max_tokens=8, stop=frozenset({9}))
    b = _add(table, sched, 1, [3], max_tokens=8, stop=frozenset({9}))
    c = _add(table, sched, 2, [4, 5, 6], max_tokens=2, stop=frozenset({9}))
    _step(sched)  # the prefill (the decode scheduled ahead of a prefill: the tests above)
    batch = sched.schedule()  # decode: lengths 3, 2, 4
    ahead = sched.schedule_ahead(batch)
    # c reaches max_tokens with this step's token: not ahead; a needs a block for its 4th token
    assert ahead.rows.tolist() == [a, b] and ahead.src_rows.tolist() == [0, 1] and table.num_blocks[a] == 2
    finished = sched.postprocess(batch, np.array([7, 9, 7]), np.zeros(3))  # b stops, c hits its length
    assert sorted(finished.tolist()) == [b, c] and table.finish[[b, c]].tolist() == [1, 2]
    for s in finished.tolist():
        table.release(s)
    assert table.slots_with(Status.RUNNING).tolist() == [a]
    sched.postprocess(ahead, np.array([8, 5]), np.zeros(2))  # b's row is void: its token is dropped
    assert _completion(table, a) == [1, 7, 8] and table.num_cached[a] == 4
    decode = sched.schedule()
    _add(table, sched, 3, [1])
    assert sched.schedule_ahead(decode) is None  # a sequence waits: if decode stops a, it is admitted first
    assert sched.ahead_off == "waiting"


def test_decode_registers_each_block_it_fills_in_the_prefix_cache():
    table, sched = _sched(num_blocks=8, block_size=2)
    a = _add(table, sched, 0, [4, 5, 6], max_tokens=4)
    _step(sched, token=7)  # prefill registers [4, 5]; samples 7 -> [4, 5, 6, 7]
    assert table.num_hashed[a] == 1
    _step(sched, token=8)  # computes the KV of 7: block [6, 7] is full -> registered
    assert table.num_hashed[a] == 2
    want = prefix_hashes(np.array([[4, 5], [6, 7]], dtype=np.int32), 0)
    assert table.last_hash[a] == want[-1] and sched.bm.hash_to_block[want[1]] == table.block_table[a, 1]


def test_the_table_grows_its_rows_and_columns_keeping_every_sequence():
    table, sched = _sched(num_blocks=96, block_size=4, max_num_seqs=None, max_num_batched_tokens=512)
    slots = [_add(table, sched, i, [i + 1] * 3, max_tokens=70) for i in range(5)]  # 5 x 18 blocks fit  # 5 > capacity 2
    assert table.capacity >= 5 and table.tokens.shape[1] == 64 and table.block_table.shape[1] >= 19
    while table.num_tokens[slots[0]] < 72:
        _step(sched, token=9)
    assert table.tokens.shape[1] >= 72  # grown while decoding past 64 tokens, contents kept
    assert [table.token_list(s) for s in slots] == [[i + 1] * 3 + [9] * 69 for i in range(5)]
    _step(sched, token=9)
    assert len(table) == 0 and table.gen[slots].tolist() == [1] * 5  # all finished (length) and released


def test_with_sequences_waiting_a_decode_is_scheduled_ahead_only_when_none_can_be_admitted():
    table, sched = _sched(num_blocks=16, block_size=4, max_num_seqs=2)
    a, b = _add(table, sched, 0, [1, 2], max_tokens=3), _add(table, sched, 1, [3], max_tokens=3)
    c = _add(table, sched, 2, [4], max_tokens=3)  # waits: the cap is 2
    _step(sched)  # a and b prefilled: 1 token each, max 3
    decode = sched.schedule()
    # the cap is reached, no stop tokens, neither reaches its length in this step: none is admitted
    ahead = sched.schedule_ahead(decode)
    assert ahead.rows.tolist() == [a, b] and ahead.src_rows.tolist() == [0, 1] and list(sched.waiting) == [c]
    sched.postprocess(decode, np.array([5, 6]), np.zeros(2))
    # the step ahead brings both to their length: the step after it may admit c
    assert sched.schedule_ahead(ahead) is None and sched.ahead_off == "waiting"
    assert sched.postprocess(ahead, np.array([7, 8]), np.zeros(2)).tolist() == [a, b]
    # with a stop token, a step may end a sequence and make room: not ahead
    table, sched = _sched(num_blocks=16, block_size=4, max_num_seqs=2)
    _add(table, sched, 0, [1, 2], max_tokens=5, stop=frozenset({9}))
    _add(table, sched, 1, [3], max_tokens=5)
    _add(table, sched, 2, [4], max_tokens=5)
    _step(sched)
    assert sched.schedule_ahead(sched.schedule()) is None and sched.ahead_off == "waiting"
