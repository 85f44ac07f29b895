"""2 ranks (gloo): claim a run directory whose disk a killed save filled (``claim_run_dir`` with
``checkpoint.resume: auto``). Usage: ``torchrun --nproc_per_node 2 claim_full_disk.py RUN_DIR``;
each rank prints ``CLAIMED rank <r> held <bool> resume <step>``."""

import sys

import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run.config import CheckpointConfig
from tidal.run.run_dir import claim_run_dir

rt = init_runtime(1, "cpu")
run = claim_run_dir(sys.argv[1], CheckpointConfig(), rt)
print(f"CLAIMED rank {rt.rank} held {run.lock.held} resume {run.resume.step if run.resume else None}", flush=True)
run.lock.release()
torch.distributed.barrier()
shutdown()
