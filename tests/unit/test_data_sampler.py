"""StatefulDistributedSampler: coverage within an epoch, per-epoch reshuffle, exact resume."""

import pytest
import torch

from tidal.data import StatefulDistributedSampler


def samplers(n=10, world=2, b=2, seed=5, shuffle=True, drop_last=True):
    return [
        StatefulDistributedSampler(n, rank=r, world_size=world, batch_size_per_rank=b, seed=seed, shuffle=shuffle, drop_last=drop_last)
        for r in range(world)
    ]


def test_unshuffled_layout_is_contiguous_per_rank():
    s0, s1 = samplers(shuffle=False)
    assert [s0.next_batch(), s1.next_batch()] == [[0, 1], [2, 3]]
    assert [s0.next_batch(), s1.next_batch()] == [[4, 5], [6, 7]]
    # 10 items, global batch 4 -> 2 steps per epoch; items 8, 9 are dropped, epoch 1 restarts at 0
    assert [s0.next_batch(), s1.next_batch()] == [[0, 1], [2, 3]]
    assert s0.epoch == 1 and s0.steps_per_epoch == 2


def test_shuffled_epoch_matches_seeded_randperm_and_has_no_repeats():
    ranks = samplers(n=12, world=3, b=2, seed=7)
    for epoch in range(3):
        seen = [i for _ in range(2) for s in ranks for i in s.next_batch()]
        expected = torch.randperm(12, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        assert seen == expected  # step-major, then rank: the epoch's permutation in order
    assert len({tuple(torch.randperm(12, generator=torch.Generator().manual_seed(7 + e)).tolist()) for e in range(3)}) == 3


def test_without_drop_last_the_last_step_wraps_around():
    (s,) = samplers(n=5, world=1, b=2, shuffle=False, drop_last=False)
    assert [s.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [4, 0], [0, 1]]


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5])
def test_resume_yields_exactly_the_same_future(consumed):
    ref = samplers(n=11, world=2, b=2, seed=1)
    for _ in range(consumed):
        for s in ref:
            s.next_batch()
    states = [s.state_dict() for s in ref]
    future = [[s.next_batch() for s in ref] for _ in range(6)]
    resumed = samplers(n=11, world=2, b=2, seed=1)
    for s, st in zip(resumed, states):
        s.load_state_dict(st)
    assert [[s.next_batch() for s in resumed] for _ in range(6)] == future


def test_resume_on_other_world_size_with_same_global_batch():
    (one,) = samplers(n=12, world=1, b=4, seed=2)
    one.next_batch()
    state = one.state_dict()
    two = samplers(n=12, world=2, b=2, seed=2)
    for s in two:
        s.load_state_dict(state)
    assert two[0].next_batch() + two[1].next_batch() == one.next_batch()


def test_incompatible_state_is_refused():
    (a,) = samplers(n=10, world=1, b=2, seed=1)
    (b,) = samplers(n=12, world=1, b=2, seed=1)
    with pytest.raises(ValueError, match="num_items=10 but this run has 12"):
        b.load_state_dict(a.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        StatefulDistributedSampler(3, rank=0, world_size=2, batch_size_per_rank=2, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        StatefulDistributedSampler(8, rank=2, world_size=2, batch_size_per_rank=2, seed=0, shuffle=True)


def test_a_resume_onto_data_of_other_content_is_refused_and_older_states_still_load():
    """Issue 44 item 8: the same number of rows, reordered, resumed silently on other prompts."""
    s = StatefulDistributedSampler(8, rank=0, world_size=1, batch_size_per_rank=2, seed=0, shuffle=True, data_hash="aaaa")
    s.next_batch()
    state = s.state_dict()
    other = StatefulDistributedSampler(8, rank=0, world_size=1, batch_size_per_rank=2, seed=0, shuffle=True, data_hash="bbbb")
    with pytest.raises(ValueError, match="content hash was aaaa and is bbbb now, with the same 8 items: rows were changed or reordered"):
        other.load_state_dict(state)
    del state["data_hash"]  # a checkpoint saved before the hash was recorded
    other.load_state_dict(state)
    assert other.next_batch() == s.next_batch()


def test_the_content_hash_sees_order_tokens_and_fields():
    import numpy as np

    from tidal.data.dataset import content_hash

    ids, offsets = np.array([1, 2, 3, 4], np.int32), np.array([0, 2, 4])
    base = content_hash(ids, offsets, np.array([0, 1]))
    assert base == content_hash(ids.copy(), offsets.copy(), np.array([0, 1]))
    assert len({base, content_hash(ids, offsets, np.array([1, 0])), content_hash(ids[::-1].copy(), offsets, np.array([0, 1])),
                content_hash(ids, offsets, np.array([0, 1]), b"reference")}) == 4
