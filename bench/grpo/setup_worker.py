"""The setup worker: environment, model folders, prompts, and (on CUDA) the device ceilings."""

from __future__ import annotations

import dataclasses
import sys

from bench.grpo.assets import model_assets, prompts_file
from bench.grpo.bounds import measure_ceilings
from bench.grpo.procs import Sink, version_of


def worker_setup(spec: dict, sink: Sink) -> None:
    """Spec: ``sizes``, ``teachers`` (the sizes among them that teach: their teacher folders too),
    ``prompt_sets`` (``[size, prompt_len, prompts_per_step]`` each)."""
    import torch
    import transformers

    device = "cuda" if spec["device"] == "cuda" else "cpu"
    env = {"kind": "env", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    for name in ("trl", "datasets", "pyarrow", "accelerate"):
        env[name] = version_of(name)
    sink.write(env)
    for size in spec["sizes"]:
        teacher = size in spec["teachers"]
        sink.write({"kind": "model", **model_assets(spec["work_dir"], size, device, teacher=teacher)})
    for size, prompt_len, per_step in spec["prompt_sets"]:
        path = prompts_file(spec["work_dir"], size=size, prompt_len=prompt_len, prompts_per_step=per_step)
        sink.write({"kind": "prompts", "size": size, "prompt_len": prompt_len, "prompts_per_step": per_step, "path": path})
    if device == "cuda":
        sink.write({"kind": "ceilings", **dataclasses.asdict(measure_ceilings())})
