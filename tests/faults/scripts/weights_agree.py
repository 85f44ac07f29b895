"""2 ranks (gloo): non-finite or corrupt weights on one rank decide for both.

1. :meth:`JobLoop.save` of weights that are NaN on rank 1 only: both ranks raise
   ``NonFiniteWeightsError`` and step 1 stays the newest checkpoint.
2. Step 2 saved with NaN on rank 1 only, step 3 with flipped bytes in rank 1's shard:
   ``load_resume("auto")`` skips both on both ranks and loads step 1.
Each rank writes ``rank<R>.json`` into ``TIDAL_TEST_OUT``."""

import json
import os
import types
from pathlib import Path

import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.logging.timer import PhaseTimer
from tidal.run import checkpoint as ckpt
from tidal.run.loop import JobLoop, LoopState

out = Path(os.environ["TIDAL_TEST_OUT"])
rt = init_runtime(1, "cpu")
r = rt.rank
root = ckpt.checkpoint_root(str(out / "run"))


def states(v: float, nan_on: int | None = None) -> dict:  # one key per rank: each rank's data in its own shard file
    value = float("nan") if r == nan_on else v
    return {"m": {f"w{r}": torch.full((8,), value)}}


class Job:
    name, state = "rl", LoopState()
    sampler = types.SimpleNamespace(state_dict=lambda: {"epoch": 0})
    value, nan_on = 1.0, None

    def model_states(self):
        return states(self.value, self.nan_on)

    def job_state(self):
        return {"algorithm": {}}


job = Job()
cfg = types.SimpleNamespace(run=types.SimpleNamespace(output_dir=str(out / "run")), checkpoint=types.SimpleNamespace(keep=1))
loop = JobLoop(job, cfg=cfg, runtime=rt, timer=PhaseTimer(), watchdog=None, logger=None, resume=None,
               required_keys=ckpt.TRAINER_STATE_KEYS)
loop.save(1)
job.value, job.nan_on = 2.0, 1
try:
    loop.save(2)
    refused = ""
except ckpt.NonFiniteWeightsError as e:
    refused = str(e)
kept = [p.name for p in ckpt.complete_checkpoints(root)]

trainer = {"step": 0, "sampler": {}, "algorithm": {}, "trainer": {}}
ckpt.save_checkpoint(root, 2, model_states=states(2.0, nan_on=1), trainer_state={**trainer, "step": 2}, runtime=rt, keep=5)
ckpt.save_checkpoint(root, 3, model_states=states(3.0), trainer_state={**trainer, "step": 3}, runtime=rt, keep=5)
torch.distributed.barrier()
if r == 1:  # flip one byte of rank 1's weights in step 3 (same size: the cheap checks pass)
    md = ckpt.read_dcp_metadata(root / "step_000003" / "models")
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "m.w1"]
    shard = root / "step_000003" / "models" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 2] ^= 0x01
    shard.write_bytes(bytes(data))
torch.distributed.barrier()
path, sd, st = ckpt.load_resume("auto", root, model_states=lambda: states(0.0), rank=r, runtime=rt)
(out / f"rank{r}.json").write_text(json.dumps({"refused": refused, "kept": kept, "step": st["step"], "w": sd["m"][f"w{r}"][0].item()}))
torch.distributed.barrier()
shutdown()
