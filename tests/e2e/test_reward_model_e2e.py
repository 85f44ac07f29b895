"""Reward-model job end to end on CPU: pairwise accuracy rises on the synthetic parity task; the
export loads as a `type: model` reward component of a RewardEngine, which scores RL-style samples
(templated prompt + response text) exactly as training did; `tidal report`, `tidal eval` and
`tidal export` work on the run directory of the shipped `rm_quickstart` config."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tidal.config import load_config
from tidal.config_base import ConfigError, build
from tidal.distributed import shutdown
from tidal.rewards import RewardConfig, RewardEngine, RewardSample
from tidal.rm.setup import build_reward_model_trainer
from tidal.rm.task import asset_dir

# the default model shape of the task on fewer, shorter pairs: learns in ~30 steps of 8 pairs
LEARNING = [
    "reward_model.task.num_train=96", "reward_model.task.num_eval=32", "reward_model.task.max_digits=2",
    "reward_model.batch_pairs=8", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.every=10",
    "checkpoint.every=0", "checkpoint.at_end=false", "logging.backends=[jsonl]", "run.steps=40",
]


def engine_for(path, **component) -> RewardEngine:
    cfg = build(RewardConfig, {"components": {"rm": {"type": "model", "path": str(path), **component}}, "recipes": {"default": [["rm", 1.0]]}})
    return RewardEngine(cfg, device=torch.device("cpu"))


def rl_samples(export, eval_file, reply_key):
    """What an RL run hands its reward model: the prompt as the policy's template renders it, the reply as text."""
    tok = AutoTokenizer.from_pretrained(export)
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False) for r in rows]
    return [RewardSample(prompt=p, response=r[reply_key], prompt_ids=[], response_ids=[]) for p, r in zip(prompts, rows)]


@pytest.mark.slow
def test_accuracy_rises_and_the_export_scores_as_trained_in_a_reward_engine(tmp_path, task_workdir):
    run = tmp_path / "run"
    cfg = load_config("rm_quickstart", LEARNING + [f"run.output_dir={run}", f"reward_model.task.workdir={task_workdir}",
                                                   "reward_model.separator=' '"])
    trainer = build_reward_model_trainer(cfg)
    try:
        metrics = trainer.fit()
    finally:
        shutdown()
    start, end = metrics["initial_eval/accuracy"], metrics["eval/accuracy"]
    assert start <= 0.7 and end >= 0.9 and end >= start + 0.25, (start, end)  # measured 0.59 -> 0.97
    assert metrics["eval/margin"] > metrics["initial_eval/margin"] + 1.0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41)) and [r["step"] for r in rows if "eval/accuracy" in r] == [10, 20, 30, 40]

    export = run / "export"
    assert json.loads((export / "tidal_reward_format.json").read_text())["separator"] == " "
    engine = engine_for(export)  # no separator given: the recorded one is used
    eval_file = asset_dir(cfg.reward_model.task) / "eval.jsonl"
    chosen = engine.score(rl_samples(export, eval_file, "chosen")).total_B
    rejected = engine.score(rl_samples(export, eval_file, "rejected")).total_B
    assert (chosen > rejected).float().mean() >= 0.9
    # the engine's scores are the trained model's own: their means equal the final evaluation's
    assert float(chosen.mean()) == pytest.approx(metrics["eval/reward_chosen"], abs=1e-4)
    assert float(rejected.mean()) == pytest.approx(metrics["eval/reward_rejected"], abs=1e-4)
    with pytest.raises(ConfigError) as info:
        engine_for(export, separator="\n")
    assert info.value.key == "reward.components.rm.separator" and "tidal_reward_format.json" in info.value.message


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_shipped_rm_quickstart_with_report_eval_and_export(tmp_path, task_workdir):
    run = tmp_path / "run"
    common = ["rm_quickstart", f"run.output_dir={run}", f"reward_model.task.workdir={task_workdir}", "logging.backends=[jsonl]"]
    out = _cli("train", *common)
    start = float(out.split("eval at start: accuracy=")[1].split(",")[0])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    end = rows[-1]["eval/accuracy"]
    assert rows[-1]["step"] == 60 and start <= 0.7 and end >= 0.95, (start, end)  # measured 0.53 -> 1.0
    _cli("report", str(run))
    assert (run / "report.png").stat().st_size > 1000
    ckpt = run / "checkpoints" / "step_000060"
    res = json.loads(_cli("eval", *common, "--checkpoint", str(ckpt)).strip().splitlines()[-1])
    assert res["step"] == 60 and res["data/eval_pairs"] == 200 and res["eval/accuracy"] == pytest.approx(end)
    _cli("export", *common, "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"))
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(run / "export" / "model.safetensors")
    assert a.keys() == b.keys() and "score.weight" in a and all(torch.equal(a[k], b[k]) for k in a)
