"""The squares task learns on CPU: GRPO on a tiny Qwen2-VL, images through the whole pipeline (data,
native engine (and the HF reference engine), actor forwards with pixel inputs, update, weight sync). The warm start used random
labels, so the start is at chance (1/3) and the gain comes from reading the images."""

import json
from pathlib import Path

import pytest

from tidal.algorithms import Algorithm
from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "squares" / "config.yaml"


def _overrides(assets, out, *extra):
    return [
        f"model.path={assets.model_path}", f"data.train=[{{path: {assets.train_path}}}]", f"data.eval=[{{path: {assets.eval_path}}}]",
        f"run.output_dir={out}", "run.device=cpu", *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "hf"])
def test_squares_reward_rises(squares_assets, tmp_path, engine):
    cfg = load_config(str(CONFIG), _overrides(squares_assets, tmp_path, f"engine.backend={engine}"))
    trainer = build_trainer(cfg)
    try:
        final = trainer.fit()
    finally:
        shutdown()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if r["step"] > 0]  # step 0 is the start-of-run evaluation
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.45, rewards  # chance is 1/3
    assert last > first + 0.15, rewards
    assert final["eval/greedy_accuracy"] > final["initial_eval/greedy_accuracy"], final
    assert final["mismatch/abs_logp_diff_mean"] < 1e-4  # engine and trainer agree on image prompts


@pytest.mark.slow
def test_squares_lora_with_kl_and_export(squares_assets, tmp_path):
    """LoRA + KL on a VL model: the reference (adapters disabled) sees the images too (KL is 0 before
    the first update), only adapters change, and the export is a VL folder with its image processor."""
    import torch

    from tidal.models import load_causal_lm, load_tokenizer
    from tidal.models.logprobs import token_logprobs
    from tidal.models.lora import AdapterDisabledReference
    from tidal.models.vision import collate_mm_inputs
    from tidal.trainer.export import export_hf

    cfg = load_config(str(CONFIG), _overrides(squares_assets, tmp_path, "run.steps=2", "eval.at_start=false", "eval.at_end=false",
                                              "model.lora.rank=4", "optim.lr=1e-2", "algorithm.kl_coef=0.05"))
    trainer = build_trainer(cfg)
    try:
        assert isinstance(trainer.models.reference, AdapterDisabledReference)
        before = {n: p.detach().full_tensor().clone() for n, p in trainer.models.actor.model.named_parameters()}
        trainer.fit()
        changed = [n for n, p in trainer.models.actor.model.named_parameters() if not torch.equal(p.detach().full_tensor(), before[n])]
        assert changed and all(".lora_" in n for n in changed)
        export_hf(trainer, str(tmp_path / "export"))
        item = trainer.data.train[0]
        ids = torch.tensor([item.prompt_ids])
        mm = collate_mm_inputs([item.mm_inputs])
        with torch.no_grad():
            want, _ = token_logprobs(trainer.models.actor.model, ids, torch.ones_like(ids), mm_inputs=mm)
    finally:
        shutdown()
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    assert not Algorithm(cfg.algorithm).reuses_policy_logprobs(cfg.train)  # two mini-batches: the experience computes old logprobs
    assert rows[0]["kl/rollout"] == 0.0 and rows[1]["kl/rollout"] > 0.0
    proc = load_tokenizer(str(tmp_path / "export"))  # tokenizer + image processor were exported
    assert proc.prompt_ids(item.prompt_text, [_image(item)]) == item.prompt_ids
    with torch.no_grad():
        got, _ = token_logprobs(load_causal_lm(str(tmp_path / "export")), ids, torch.ones_like(ids), mm_inputs=mm)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _image(item):
    from tidal.data.vision import load_image

    return load_image(item.images[0], Path(item.source).parent)
