"""`tidal eval` and `tidal export` of a reward-model checkpoint say what they loaded and what they
wrote, and where (issue 23 item 8), like the RL job's; `tidal train` says "resumed from" only when it
resumes training. The export keeps the training dtype unless `--dtype` says otherwise."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tidal.cli import main

TINY = ["reward_model.task.num_train=16", "reward_model.task.num_eval=8", "reward_model.task.max_digits=2",
        "reward_model.batch_pairs=8", "eval.every=0", "eval.at_start=false", "eval.at_end=false",
        "checkpoint.every=2", "logging.backends=[jsonl]", "reward_model.export_at_end=true"]


@pytest.mark.slow  # about 15 s: the task's assets, a 2-step run, eval, two exports
def test_rm_eval_and_export_say_what_they_loaded_and_wrote(tmp_path, task_workdir, capsys):
    run = tmp_path / "run"
    common = ["rm_quickstart", f"run.output_dir={run}", f"reward_model.task.workdir={task_workdir}", *TINY]
    assert main(["train", *common, "run.steps=2"]) == 0
    out = capsys.readouterr().out
    assert "resumed" not in out
    assert f"exported the reward model of step 2 (the end of training) to {(run / 'export').resolve()}" in out
    ckpt = run / "checkpoints" / "step_000002"

    assert main(["eval", *common, "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"evaluating the reward model of checkpoint {ckpt} (step 2) on 8 eval pairs" in out and "resumed" not in out
    assert json.loads(out.strip().splitlines()[-1])["step"] == 2

    assert main(["export", *common, "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "resumed" not in out
    assert (f"exported the reward model of checkpoint {ckpt} (step 2) to {(tmp_path / 'hf').resolve()} "
            "(a Hugging Face sequence classifier folder: weights in float32") in out  # the CPU's training dtype
    assert main(["export", *common, "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf16"), "--dtype", "bfloat16"]) == 0
    assert "weights in bfloat16" in capsys.readouterr().out
    full, half = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "hf16" / "model.safetensors")
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    # the end-of-training export is the checkpoint's weights
    assert all(torch.equal(a, full[k]) for k, a in load_file(run / "export" / "model.safetensors").items())

    assert main(["train", *common, "run.steps=4"]) == 0  # training on from the checkpoint says so
    assert f"resumed from {ckpt} (step 2)" in capsys.readouterr().out
