"""rollout.partial in a rollout TP group: two gloo ranks on CPU share one (scripted) engine, each
with its own groups; both make the same engine calls and stop when both have their complete groups."""

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.engine.base import SamplingParams
from tidal.trainer.config import PartialRolloutConfig
from tidal.trainer.experience import STEP_GROUPS
from tidal.trainer.partial import LongTailRollout

from tests.runtimes import spawned_runtime

from .test_partial_rollout import Item, ScriptedEngine

# rank 0's rows finish fast (1 token); rank 1's row 100 takes 4 tokens, its row 101 and 102 two and three
LENGTHS = {(100, 0): 4, (100, 1): 4, (101, 0): 2, (101, 1): 2, (102, 0): 3, (102, 1): 1}


def _worker(rank: int, store: str, out_dir: str, cfg: dict | None = None, steps: int = 2):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    rows = [Item(prompt_ids=[i, 1]) for i in range(200)]
    nxt = {"i": 100 * rank}

    def draw():
        nxt["i"] += 2
        return [nxt["i"] - 2, nxt["i"] - 1]

    cfg = cfg or {"mode": "carry", "oversample": 0.5}
    lt = LongTailRollout(PartialRolloutConfig(**cfg), groups_per_step=2, n_samples=2, rank=rank,
                         runtime=spawned_runtime(rank, 2, tp_size=2), dataset=rows, draw=draw)
    eng = ScriptedEngine(LENGTHS)
    out = []
    for step in range(1, steps + 1):
        eng.policy_version = step - 1
        trained, m, _ = lt.collect(eng, step, SamplingParams(max_new_tokens=8, n=2, seed=3))
        out.append(([g.index for g in trained], [g.gid for g in trained], m["partial/engine_steps"], m["partial/staleness_max"],
                    m["partial/in_flight"]))
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((out, [[r.request_id for r in batch] for batch in eng.added]), f)
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~17 s on 2 shared cores
def test_tp_group_runs_in_lockstep(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    (out0, added0), (out1, added1) = (pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1))
    assert added0 == added1  # the same engine calls on both ranks
    assert len(added0[0]) == 2 * 3 * 2  # both ranks' 3 groups of 2, rank 0's first
    # step 1: rank 0 has 2 complete groups after 1 engine step, rank 1 (rows 101, 102) after 3: the group steps 3 times
    assert out0[0][:3] == ([0, 1], [STEP_GROUPS, STEP_GROUPS + 1], 3)
    assert out1[0][:3] == ([101, 102], [STEP_GROUPS + 3 + 1, STEP_GROUPS + 3 + 2], 3)
    # step 2: rank 1's row 100 (3 tokens so far) finishes after 1 more step with its new rows
    assert out1[1][0][0] == 100 and out0[1][2] == out1[1][2] == 1


@pytest.mark.slow
def test_tp_group_waits_for_every_ranks_due_groups(tmp_path):
    """oversample auto, max_staleness 0: rank 1's row 100 (4 tokens) is due in the rollout that
    starts it, so both ranks step until it completes although rank 0 has its groups after 1 step;
    each rank sizes its own groups in flight, and both make the same engine calls."""
    cfg = {"mode": "carry", "oversample": "auto", "max_staleness": 0}
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path), cfg, 3), nprocs=2, start_method="spawn")
    (out0, added0), (out1, added1) = (pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1))
    assert added0 == added1
    assert [o[2] for o in out0] == [o[2] for o in out1] and out0[0][2] == 4  # row 100's 4 tokens
    assert all(o[3] == 0 for o in out0 + out1)  # nothing stale: every group completes in its rollout
