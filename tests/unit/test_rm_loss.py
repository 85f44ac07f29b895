"""Bradley-Terry loss and pairwise statistics with hand-computed values; the training step obeys the
Strategy's gradient contract (micro-batching changes nothing) and skips a non-finite step."""

import math

import pytest
import torch

from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.rm.dataset import Pair
from tidal.rm.loss import PairMeans, bradley_terry_loss, pair_sums
from tidal.rm.model import collate_pairs
from tidal.rm.setup import build_reward_model_trainer
from tidal.rm.trainer import pair_micro_batches
from tidal.run import faults

from tests.tolerance import rounding_tol


def test_bradley_terry_values():
    r_c, r_r = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss = bradley_terry_loss(r_c, r_r)
    expected = [math.log(1 + math.exp(-2.0)), math.log(2.0), math.log(1 + math.exp(2.0))]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    centred = bradley_terry_loss(r_c, r_r, center_coef=0.1)
    assert (centred - loss).tolist() == pytest.approx([0.1 * 4.0, 0.0, 0.0], abs=1e-6)  # coef * (r_c + r_r)^2


def test_pair_statistics_count_a_tie_as_half():
    r_c, r_r = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    sums = pair_sums(r_c, r_r, bradley_terry_loss(r_c, r_r))
    means = PairMeans()
    means.add(sums, 3)
    means.add(pair_sums(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.5])), 1)
    out = means.result(lambda values: [2 * v for v in values])  # two identical ranks
    assert out["accuracy"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert out["margin"] == pytest.approx((2 + 0 - 2 + 1) / 4)
    assert out["reward_chosen"] == pytest.approx(2 / 4) and out["reward_rejected"] == pytest.approx(1 / 4)
    assert out["pairs"] == 8
    assert math.isnan(PairMeans().result(lambda v: v)["accuracy"])


def test_collate_puts_chosen_first_right_padded():
    pairs = [Pair(chosen_ids=[1, 2, 3], rejected_ids=[4], where="a"), Pair(chosen_ids=[5], rejected_ids=[6, 7], where="b")]
    ids, mask = collate_pairs(pairs, pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[1, 2, 3], [5, 0, 0], [4, 0, 0], [6, 7, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 0]]


def test_micro_batches_keep_pairs_whole_within_the_budget():
    pairs = [Pair(chosen_ids=[0] * n, rejected_ids=[0] * (n + 1), where="") for n in (3, 7, 5, 2, 9)]
    batches = pair_micro_batches(pairs, max_tokens=40, max_seqs=4)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert len(batches) > 1
    for b in batches:  # within both budgets, or a single pair
        assert len(b) == 1 or (2 * len(b) <= 4 and 2 * len(b) * max(pairs[i].length for i in b) <= 40)


def _step(overrides, tiny_rm_overrides, tmp_path, steps=1):
    """(metrics per step, the gradients the last optimizer step was given)."""
    cfg = load_config("rm_quickstart", tiny_rm_overrides + [f"run.output_dir={tmp_path}", "eval.at_start=false",
                                                             "reward_model.export_at_end=false", *overrides])
    trainer = build_reward_model_trainer(cfg)
    grads, optimizer_step = {}, trainer.strategy.optimizer_step

    def recording_step(state):
        for n, p in trainer.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.detach().clone()
        return optimizer_step(state)

    trainer.strategy.optimizer_step = recording_step
    try:
        metrics = [trainer.train_step(s) for s in range(1, steps + 1)]
    finally:
        shutdown()
    return metrics, grads


def test_micro_batching_gives_the_global_batch_gradient(tmp_path, tiny_rm_overrides):
    """The gradient, not the parameters after Adam: its first step moves each element by
    lr * g / (|g| + eps), which maps rounding noise in a gradient that is 0 in exact math (a key
    projection's bias: softmax ignores it) to a sizeable fraction of lr. Tolerances are the dtype's
    rounding at each tensor's magnitude (tests/tolerance.py), so they hold on any CPU."""
    (one,), g_one = _step(["train.micro_batch_tokens=100000"], tiny_rm_overrides, tmp_path / "a")
    (many,), g_many = _step(["train.micro_batch_tokens=40", "train.micro_batch_max_seqs=2"], tiny_rm_overrides, tmp_path / "b")
    assert one["train/loss"] == pytest.approx(many["train/loss"], abs=rounding_tol(torch.float32, one["train/loss"]))
    assert one["train/grad_norm"] == pytest.approx(many["train/grad_norm"], abs=rounding_tol(torch.float32, one["train/grad_norm"]))
    assert one["train/grad_norm"] > 0
    for n, g in g_one.items():
        assert g.dtype == torch.float32 and g.abs().max() > 0, n
        torch.testing.assert_close(g_many[n], g, rtol=0, atol=rounding_tol(g.dtype, g), msg=n)
    assert one["train/skipped"] == 0.0 and 0.0 <= one["train/accuracy"] <= 1.0


def test_non_finite_scores_skip_the_step_and_stop_after_k_in_a_row(tmp_path, tiny_rm_overrides, monkeypatch):
    monkeypatch.setattr(faults, "_RULES", faults.parse("nan@rm_scores:step=2-"))
    cfg = load_config("rm_quickstart", tiny_rm_overrides + [f"run.output_dir={tmp_path}", "train.max_skipped_steps_in_a_row=2"])
    trainer = build_reward_model_trainer(cfg)
    try:
        faults.set_step(1)
        first = trainer.loop.step(1)  # the job's step with the job loop's skip accounting
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        faults.set_step(2)
        second = trainer.loop.step(2)
        assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
        faults.set_step(3)
        with pytest.raises(RuntimeError, match=r"2 optimizer steps in a row .*train.max_skipped_steps_in_a_row=2"):
            trainer.loop.step(3)
    finally:
        shutdown()
    assert first["train/skipped"] == 0.0 and second["train/skipped"] == 1.0 and second["train/skipped_total"] == 1.0


def test_center_rewards_coef_adds_its_term(tmp_path, tiny_rm_overrides):
    (base,), _ = _step([], tiny_rm_overrides, tmp_path / "a")
    (centred,), _ = _step(["reward_model.center_rewards_coef=0.5"], tiny_rm_overrides, tmp_path / "b")
    scores = max(abs(base["train/reward_chosen"]), abs(base["train/reward_rejected"]))
    assert centred["train/margin"] == pytest.approx(base["train/margin"], abs=rounding_tol(torch.float32, scores))  # same model, same pairs
    mean_sum = base["train/reward_chosen"] + base["train/reward_rejected"]
    slack = rounding_tol(torch.float32, centred["train/loss"])
    assert centred["train/loss"] - base["train/loss"] >= 0.5 * mean_sum**2 - slack  # mean of squares >= square of mean


def test_fit_without_export_and_with_fewer_eval_pairs(tmp_path, tiny_rm_overrides):
    cfg = load_config("rm_quickstart", tiny_rm_overrides + [f"run.output_dir={tmp_path}", "run.steps=1",
                                                             "reward_model.export_at_end=false", "eval.max_prompts=5"])
    trainer = build_reward_model_trainer(cfg)
    try:
        metrics = trainer.fit()
    finally:
        shutdown()
    assert metrics["initial_data/eval_pairs"] == 5 and metrics["data/eval_pairs"] == 5
    assert not (tmp_path / "export").exists() and (tmp_path / "metrics.jsonl").is_file()
