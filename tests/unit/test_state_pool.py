"""The recurrent-state slot pool's bookkeeping (tidal.engine.native.state_pool) on a stand-in layer."""

import torch

from tidal.engine.native.state_pool import StatePool


class Layer:
    def state_shapes(self):
        return (3, 2), (2, 2, 2)


def _pool(slots=4):
    layer = Layer()
    return StatePool([layer], slots, torch.device("cpu")), layer


def test_admit_zeroes_and_checkpoint_copies_in_order():
    pool, layer = _pool()
    pool.begin_step()
    pool.admit(10)
    pool.apply()
    s = pool.slot_of[10]
    layer.ssm_state[s] += 1.0  # the step computed a state
    pool.save(10, block_hash=77)
    assert pool.lookup([77]) == (0, None) and pool.pending(77)  # not visible in the step that saves it
    pool.begin_step()
    k, ckpt = pool.lookup([5, 77])
    assert (k, ckpt) == (2, pool.checkpoints[77])
    pool.admit(11, ckpt)  # the save's copy runs before this load
    pool.apply()
    assert torch.equal(layer.ssm_state[pool.slot_of[11]], layer.ssm_state[s])
    assert layer.ssm_state[s].eq(1).all()


def test_slots_are_freed_and_checkpoints_evicted_least_recent_first():
    pool, _ = _pool(slots=3)
    pool.begin_step()
    pool.admit(1)
    pool.save(1, 100)
    pool.save(1, 200)
    pool.begin_step()
    pool.begin_step()  # nothing reads them now
    assert pool.can_admit() and set(pool.checkpoints) == {100, 200}
    pool.admit(2)  # the last slot goes to the least recently used checkpoint
    assert set(pool.checkpoints) == {200}
    pool.free(1)
    pool.admit(3)
    assert pool.can_admit() and set(pool.checkpoints) == {200}  # only by evicting the checkpoint
    pool.admit(4)
    assert not pool.checkpoints and not pool.can_admit()


def test_decode_checkpoint_bound_after_its_step_or_dropped():
    pool, _ = _pool(slots=4)
    pool.begin_step()
    pool.admit(1)
    pool.admit(2)
    pool.save(1, None, boundary=8)
    pool.save(2, None, boundary=8)
    pool.begin_step()  # copies queued; hashes unknown yet
    pool.bind(1, 8, 123)  # row 1's step done; row 2 had finished (never bound)
    pool.begin_step()
    pool.begin_step()
    assert list(pool.checkpoints) == [123]
    assert len(pool._free) == 1  # row 2's checkpoint slot came back


def test_copy_groups_keep_order():
    pool, layer = _pool(slots=4)
    layer.ssm_state[0] = 1.0
    pool._copies = [(0, 1), (1, 2), (-1, 0), (0, 3)]
    pool.apply()
    assert layer.ssm_state[1].eq(1).all() and layer.ssm_state[2].eq(1).all()
    assert layer.ssm_state[0].eq(0).all() and layer.ssm_state[3].eq(0).all()
