"""2 ranks (gloo): save steps 1 and 2, spoil rank 1's part of step 2 so that only rank 1 fails to
load it, then ``load_resume("auto")`` with the runtime: both ranks must end on step 1.
Usage: ``torchrun --nproc_per_node 2 resume_agree.py ROOT``; each rank prints ``RESUMED <step> <w>``."""

import sys
from pathlib import Path

import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.run import checkpoint as ckpt
from tests.faults.old_checkpoints import as_saved_before_checksums

root = Path(sys.argv[1])
rt = init_runtime(1, "cpu")
r = rt.rank


def states(v: float) -> dict:  # one key per rank: each rank's data lands in its own shard file
    return {"m": {f"w{r}": torch.full((8,), v), f"hp{r}": {"lr": v}}}


for step in (1, 2):
    ckpt.save_checkpoint(root, step, model_states=states(float(step)), runtime=rt, keep=5,
                         trainer_state={"step": step, "sampler": {}, "algorithm": {}, "trainer": {}})
torch.distributed.barrier()
if r == 1:  # zero rank 1's bytes item in step 2 (same size: the cheap checks pass; loading fails on rank 1)
    md = ckpt.read_dcp_metadata(root / "step_000002" / "models")
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "m.hp1.lr"]
    shard = root / "step_000002" / "models" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + info.length] = b"\0" * info.length
    shard.write_bytes(bytes(data))
    as_saved_before_checksums(root / "step_000002")  # only loading finds it
torch.distributed.barrier()
got = ckpt.load_resume("auto", root, model_states=lambda: states(0.0), rank=r, runtime=rt)
assert got is not None
path, sd, st = got
print(f"RESUMED rank {r} step {st['step']} w {sd['m'][f'w{r}'][0].item()} lr {sd['m'][f'hp{r}']['lr']}", flush=True)
# both ranks reach the end before either tears its process group down: without it, one rank in three
# aborted in gloo's teardown ("terminate called without an active exception") after a rank's failed load
torch.distributed.barrier()
shutdown()
