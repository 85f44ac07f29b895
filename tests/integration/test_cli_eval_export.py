"""`tidal report`, `tidal eval` and `tidal export` on a real run directory and checkpoint of a tiny run."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_eval_and_export_from_checkpoint(tmp_path, tiny_task_overrides):
    run = tmp_path / "run"
    common = ["quickstart", *tiny_task_overrides, f"run.output_dir={run}", "optim.lr=1e-2",
              "reward.components.correct.path=tests.e2e.rewards:text_hash_reward"]  # varied rewards: a real update
    _cli("train", *common, "run.steps=1")
    ckpt = run / "checkpoints" / "step_000001"
    assert (ckpt / "trainer.json").is_file()
    _cli("report", str(run))  # the report renders from a real run directory
    assert (run / "report.png").stat().st_size > 1000
    assert "data:image/png;base64," in (run / "report.html").read_text()
    out = _cli("eval", *common, "--checkpoint", str(ckpt), "eval.greedy=true")  # an override after --checkpoint
    assert f"evaluating the actor of checkpoint {ckpt} (step 1; the run's config {run / 'config.yaml'}) on 16 eval prompts" in out and "resumed" not in out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["step"] == 1 and res["eval/prompts_count"] == 16 and 0.0 <= res["eval/greedy_accuracy"] <= 1.0
    out = _cli("export", *common, "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "run.seed=1")
    assert f"exported the actor of checkpoint {ckpt} (step 1) to {(tmp_path / 'hf').resolve()}" in out
    assert "weights in float32" in out  # the dtype it trained in on the CPU (strategy.param_dtype auto)
    _cli("export", *common, "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf16"), "--dtype", "bfloat16")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", dtype="auto")
    assert half.dtype == torch.bfloat16 and json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token is not None
    # the exported weights are the trained ones: they differ from the task's warm-started model
    from tidal.config import load_config
    from tidal.tasks import prepare

    base = AutoModelForCausalLM.from_pretrained(prepare(load_config(common[0], common[1:]).task).model_path)
    diffs = [not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values())]
    assert any(diffs)
