"""Rollout TP/DP groups (spec §2.2) and the single-process runtime."""

import pytest

from tidal.config_base import ConfigError
from tidal.distributed.runtime import rollout_group_ranks


def test_groups_world8_tp2():
    tp, dp = rollout_group_ranks(8, 2)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_groups_world8_tp4_and_tp1():
    tp, dp = rollout_group_ranks(8, 4)
    assert tp == [[0, 1, 2, 3], [4, 5, 6, 7]] and dp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    tp, dp = rollout_group_ranks(3, 1)
    assert tp == [[0], [1], [2]] and dp == [[0, 1, 2]]


def test_indivisible_world_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE % engine.tp_size != 0 \(6 % 4\)"):
        rollout_group_ranks(6, 4)
