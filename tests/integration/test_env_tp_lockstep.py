"""2-rank torchrun (gloo, CPU), one rollout TP group: multi-turn rollouts whose ranks need different
numbers of turns keep the sharded engine's calls in lockstep (scripts/env_tp_lockstep.py)."""

import re
from pathlib import Path

import pytest

from tests.torchrun_scripts import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "env_tp_lockstep.py"


@pytest.mark.slow
def test_multi_turn_rollouts_stay_in_lockstep_over_a_tp_group(tmp_path):
    r0, r1 = run_ranks(SCRIPT, tmp_path)
    # the same engine calls with the same arguments, although rank 1 finished after its first turn
    assert r0["calls"] == r1["calls"] and len(r0["calls"]) >= 3
    assert r0["turns"] == [3] * 6 and r1["turns"] == [1] * 4
    assert set(r0["finish"]) == set(r1["finish"]) == {"done"}
    # a rank's trajectories are those of its rollout run alone on an unsharded engine
    assert r0["equal_alone"] and r1["equal_alone"]
    # continuous (add/step, requests exchanged before every step): the same add/step calls on both
    # ranks, the same trajectories as rounds on an unsharded engine, the engine idle at the end
    assert r0["cont_calls"] == r1["cont_calls"] and r0["cont_adds"] >= 3
    assert r0["cont_equal_alone"] and r1["cont_equal_alone"] and r0["cont_idle"] and r1["cont_idle"]
    assert r0["cont_turns"] == [3] * 6 and r1["cont_turns"] == [1] * 4
    # single_turn: one engine call for the group, as a plain rollout; a rank without prompts joins it
    assert r0["single_calls"] == r1["single_calls"] and len(r0["single_calls"]) == 1 and r0["single_equal"] and r1["single_equal"]
    # an environment error on rank 1 stops both ranks with it (rank 0 does not wait for rank 1)
    assert re.search(r"environment 'environment' failed on row rank1:\d", r1["failure"]) and "ValueError: boom" in r1["failure"]
    assert r0["failure"].startswith("another rank of the rollout TP group failed: rank 1: EnvError") and "on row rank1:" in r0["failure"]
    assert r0["failure_idle"] and r1["failure_idle"]
    assert r0["empty_calls"] == r1["empty_calls"] and len(r0["empty_calls"]) == 1 and r1["empty_n"] == 0
