"""Save checkpoints of a tiny state in a world of one: ``ckpt_worker.py ROOT KEEP STEP:VALUE ...``.

Each STEP:VALUE saves ``{"m": {"w": full((4,), VALUE)}}`` with trainer state ``{"step", "value"}``
through :func:`tidal.run.checkpoint.save_checkpoint`, in order; ``TIDAL_FAULT`` may kill or
fail the process at one of its points (that is the point of this script).
"""

import sys
from pathlib import Path

import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run import checkpoint as ckpt

root, keep = Path(sys.argv[1]), int(sys.argv[2])
rt = init_runtime(1, "cpu")
for spec in sys.argv[3:]:
    step, value = (int(x) for x in spec.split(":"))
    states = {"m": {"w": torch.full((4,), float(value))}}
    ckpt.save_checkpoint(root, step, model_states=states, trainer_state={"step": step, "value": value}, runtime=rt, keep=keep)
    print(f"saved step {step}", flush=True)
shutdown()
