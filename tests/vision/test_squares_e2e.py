"""The squares task learns on CPU: GRPO on a tiny Qwen2-VL, images through the whole pipeline (data,
HF engine, actor forwards with pixel inputs, update, weight sync). The warm start used random
labels, so the start is at chance (1/3) and the gain comes from reading the images."""

import json
from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.trainer.setup import build_trainer

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "squares" / "config.yaml"


def _overrides(assets, out, *extra):
    return [
        f"model.path={assets.model_path}", f"data.train=[{{path: {assets.train_path}}}]", f"data.eval=[{{path: {assets.eval_path}}}]",
        f"run.output_dir={out}", "run.device=cpu", *extra,
    ]


@pytest.mark.slow
def test_squares_reward_rises(squares_assets, tmp_path):
    cfg = load_config(str(CONFIG), _overrides(squares_assets, tmp_path))
    trainer = build_trainer(cfg)
    try:
        final = trainer.fit()
    finally:
        shutdown()
    rewards = [json.loads(line)["reward/mean"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.45, rewards  # chance is 1/3
    assert last > first + 0.15, rewards
    assert final["eval/greedy_accuracy"] > final["initial_eval/greedy_accuracy"], final
    assert final["mismatch/abs_logp_diff_mean"] < 1e-4  # engine and trainer agree on image prompts
