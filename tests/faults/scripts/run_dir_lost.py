"""2 ranks (gloo): claim a run directory, check it (intact), remove it on rank 0 only, check again:
every rank must raise RunDirLost (the check is a collective). Usage: ``torchrun --nproc_per_node 2
run_dir_lost.py RUN_DIR``; each rank prints ``INTACT rank <r>`` then ``LOST rank <r>: <message>``."""

import shutil
import sys

import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run.config import CheckpointConfig
from tidal.run.run_dir import claim_run_dir
from tidal.run.run_lock import RunDirLost

rt = init_runtime(1, "cpu")
run = claim_run_dir(sys.argv[1], CheckpointConfig(), rt)
run.check_intact(rt)
print(f"INTACT rank {rt.rank}", flush=True)
torch.distributed.barrier()
if rt.rank == 0:
    shutil.rmtree(sys.argv[1])
torch.distributed.barrier()
try:
    run.check_intact(rt)
except RunDirLost as e:
    print(f"LOST rank {rt.rank}: {e}", flush=True)
torch.distributed.barrier()
shutdown()
