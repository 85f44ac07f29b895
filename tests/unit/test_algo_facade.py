"""The Algorithm facade: mismatch correction, entropy terms, reward processing, dynamic-sampling
filter, truncation mask, advantage normalisation, value loss and state."""

import math

import pytest
import torch

from tidal.algorithms import (
    AdvantageInput,
    Algorithm,
    AlgorithmConfig,
    DynamicSamplingConfig,
    LossNormalizer,
    MismatchConfig,
    OverlongConfig,
)


def _pg_only(algo, old, rollout, adv, mask, entropy=None):
    """policy_loss with logp == old (ratio 1) so the PPO term per token is -A * w."""
    logp = old.clone().requires_grad_(True)
    return algo.policy_loss(logp, old, adv, mask, LossNormalizer.from_mask(mask), rollout_logp_BT=rollout, entropy_BT=entropy)


# ---- rollout/trainer mismatch -----------------------------------------------------------------
OLD = torch.tensor([[-1.0, -1.0, -1.0]])
ROLLOUT = torch.tensor([[-1.5, -0.5, -1.0]])  # log rho = [.5, -.5, 0]
RHO = [math.exp(0.5), math.exp(-0.5), 1.0]


def test_mismatch_metrics_without_correction():
    _, m = _pg_only(Algorithm(AlgorithmConfig()), OLD, ROLLOUT, torch.ones(1, 3), torch.ones(1, 3))
    assert m["mismatch_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in RHO) / 3, rel=1e-5)
    assert m["mismatch_abs_logp_diff"].item() == pytest.approx(1.0 / 3, rel=1e-6)
    assert "mismatch_is_weight" not in m


@pytest.mark.parametrize(
    "mode, lower, weights, frac",
    [
        ("token_truncate", 0.0, [1.5, RHO[1], 1.0], 1 / 3),
        ("token_mask", 0.7, [0.0, 0.0, 1.0], 2 / 3),
    ],
)
def test_token_level_truncated_is(mode, lower, weights, frac):
    algo = Algorithm(AlgorithmConfig(mismatch=MismatchConfig(mode=mode, cap=1.5, lower=lower)))
    loss, m = _pg_only(algo, OLD, ROLLOUT, torch.ones(1, 3), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-sum(weights) / 3, rel=1e-5)
    assert m["mismatch_is_weight"].item() == pytest.approx(sum(weights) / 3, rel=1e-5)
    assert m["mismatch_corrected_frac"].item() == pytest.approx(frac)


@pytest.mark.parametrize("mode, w1", [("seq_truncate", 1.5), ("seq_mask", 0.0)])
def test_sequence_level_truncated_is(mode, w1):
    # row 0: log rho [.5, -.2] -> rho = e^.3 (kept); row 1: log rho [.6] (+ padding) -> e^.6 > 1.5
    old = torch.tensor([[-1.0, -1.0], [-1.0, -7.0]])
    rollout = torch.tensor([[-1.5, -0.8], [-1.6, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    algo = Algorithm(AlgorithmConfig(mismatch=MismatchConfig(mode=mode, cap=1.5)))
    loss, m = _pg_only(algo, old, rollout, torch.ones(2, 2), mask)
    w0 = math.exp(0.3)
    assert loss.item() == pytest.approx(-(2 * w0 + w1) / 3, rel=1e-5)
    assert m["mismatch_corrected_frac"].item() == pytest.approx(1 / 3)  # the 1 token of row 1, of 3


def test_mismatch_correction_requires_rollout_logprobs():
    algo = Algorithm(AlgorithmConfig(mismatch=MismatchConfig(mode="token_truncate")))
    with pytest.raises(ValueError, match="rollout_logp_BT"):
        algo.policy_loss(OLD, OLD, torch.ones(1, 3), torch.ones(1, 3), LossNormalizer(num_tokens=3, num_seqs=1))


# ---- entropy ---------------------------------------------------------------------------------
def test_entropy_bonus_and_metric():
    algo = Algorithm(AlgorithmConfig(entropy_coef=0.1))
    ent = torch.tensor([[0.5, 1.5, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = algo.policy_loss(OLD.clone(), OLD, torch.zeros(1, 3), mask, LossNormalizer.from_mask(mask), entropy_BT=ent)
    assert loss.item() == pytest.approx(-0.1 * 1.0)
    assert m["entropy"].item() == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, ent)
    assert grad.tolist()[0] == pytest.approx([-0.05, -0.05, 0.0])


def test_high_entropy_tokens_only():
    # entropies of the 5 response tokens: .1 .9 .5 .7 .3 (and a masked 9.0); q = .4 -> top 2: .9 and .7
    algo = Algorithm(AlgorithmConfig(entropy_top_q=0.4))
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.7, 0.3, 9.0]])
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    logp = torch.full((1, 6), -1.0, requires_grad=True)
    loss, m = algo.policy_loss(logp, logp.detach(), adv, mask, LossNormalizer.from_mask(mask), entropy_BT=ent)
    # only tokens 1 and 3 keep the policy term; the normaliser stays all 5 response tokens
    assert loss.item() == pytest.approx(-(2.0 + 4.0) / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist()[0] == pytest.approx([0.0, -2.0 / 5, 0.0, -4.0 / 5, 0.0, 0.0])
    assert m["entropy_selected_frac"].item() == pytest.approx(0.4)


def test_high_entropy_mode_requires_entropy():
    algo = Algorithm(AlgorithmConfig(entropy_top_q=0.2))
    with pytest.raises(ValueError, match="entropy_BT"):
        algo.policy_loss(OLD, OLD, torch.ones(1, 3), torch.ones(1, 3), LossNormalizer(num_tokens=3, num_seqs=1))


# ---- reward processing, dynamic sampling, truncation -------------------------------------------
def test_process_rewards_is_identity_by_default():
    algo = Algorithm(AlgorithmConfig())
    r = torch.tensor([1.0, -2.0, 0.5])
    out, m = algo.process_rewards(r, torch.tensor([0, 0, 1]), torch.tensor([3, 12, 7]))
    assert torch.equal(out, r)
    assert m == {}  # the raw reward and the truncated fraction are the rollout's metrics (reward/mean, response/truncated_frac)


def test_overlong_soft_penalty_by_hand():
    # L_max 10, buffer 4: lengths 5 (free), 8 -> (6 - 8) / 4 = -.5, 10 -> -1, 12 -> -1 ; factor .5
    algo = Algorithm(AlgorithmConfig(overlong=OverlongConfig(buffer_len=4, max_len=10, penalty_factor=0.5)))
    out, m = algo.process_rewards(torch.ones(4), torch.arange(4), torch.tensor([5, 8, 10, 12]))
    assert out.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.5])
    assert m["overlong_penalty"] == pytest.approx((0 - 0.25 - 0.5 - 0.5) / 4)


def test_running_reward_normalisation_and_clip():
    algo = Algorithm(AlgorithmConfig(reward_norm="running", reward_clip=1.0))
    g, n = torch.zeros(3, dtype=torch.long), torch.ones(3)
    out, m = algo.process_rewards(torch.tensor([1.0, 2.0, 3.0]), g, n)  # mean 2, var 2/3
    assert out.tolist() == pytest.approx([-1.0, 0.0, 1.0])  # +-1/sqrt(2/3) = +-1.22 clipped to +-1
    assert m["reward_clip_frac"] == pytest.approx(2 / 3)
    out, _ = algo.process_rewards(torch.tensor([4.0, 5.0]), g[:2], n[:2])  # moments of 1..5: mean 3, var 2
    assert out.tolist() == pytest.approx([1 / math.sqrt(2), 1.0])


def test_dynamic_sampling_keeps_groups_with_reward_variance():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    on = Algorithm(AlgorithmConfig(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_tries=4)))
    assert on.keep_groups(r, g).tolist() == [False, False, True, True, False, False]
    assert on.cfg.dynamic_sampling.max_tries == 4
    assert Algorithm(AlgorithmConfig()).keep_groups(r, g).all()


def test_truncated_completions_masked_only_when_configured():
    trunc = torch.tensor([True, False])
    assert Algorithm(AlgorithmConfig(overlong=OverlongConfig(mask_truncated=True))).loss_mask_B(trunc).tolist() == [0.0, 1.0]
    assert Algorithm(AlgorithmConfig()).loss_mask_B(trunc).tolist() == [1.0, 1.0]


# ---- advantage normalisation ----------------------------------------------------------------
def _inp(rewards, mask):
    return AdvantageInput(rewards_B=torch.tensor(rewards), action_mask_BT=torch.tensor(mask),
                          group_ids_B=torch.arange(len(rewards)))


def test_batch_advantage_whitening_and_clip():
    # reinforce, rewards 3 and 1 on 2 + 1 tokens: A tokens [3, 3, 1]: mean 7/3, var 8/9
    algo = Algorithm(AlgorithmConfig(advantage="reinforce", adv_norm="batch", adv_clip=1.0))
    adv, ret = algo.compute_advantages(_inp([3.0, 1.0], [[1.0, 1.0], [1.0, 0.0]]))
    z = (3 - 7 / 3) / math.sqrt(8 / 9 + 1e-8)
    assert z < 1.0 and adv[0].tolist() == pytest.approx([z, z], rel=1e-5)
    assert adv[1].tolist() == pytest.approx([-1.0, 0.0])  # -2 z = -1.41 clipped
    assert ret.tolist() == [[3.0, 3.0], [1.0, 0.0]]


def test_running_advantage_normalisation():
    algo = Algorithm(AlgorithmConfig(advantage="reinforce", adv_norm="running"))
    algo.compute_advantages(_inp([1.0, 3.0], [[1.0], [1.0]]))  # moments of [1, 3]
    adv, _ = algo.compute_advantages(_inp([5.0], [[1.0]]))  # moments of [1, 3, 5]: mean 3, var 8/3
    assert adv.item() == pytest.approx(2 / math.sqrt(8 / 3), rel=1e-6)
    fresh = Algorithm(AlgorithmConfig(advantage="reinforce", adv_norm="running"))
    fresh.load_state_dict(algo.state_dict())
    assert fresh.adv_moments.mean == pytest.approx(3.0)


# ---- value loss -------------------------------------------------------------------------------
def test_clipped_value_loss_by_hand():
    # V = [1, 0], V_old = [.5, .5], R = [2, -1], clip .2: clipped values .7 / .3 are further from R:
    # 0.5 * max(1, 1.69) per token; coef .5; the clipped branch gives no gradient
    algo = Algorithm(AlgorithmConfig(advantage="gae", value_clip=0.2, value_loss_coef=0.5))
    v = torch.tensor([[1.0, 0.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, m = algo.value_loss(v, torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, -1.0]]), mask, LossNormalizer.from_mask(mask))
    assert loss.item() == pytest.approx(0.5 * 0.5 * 1.69)
    assert m["value_loss"].item() == pytest.approx(0.5 * 1.69) and m["value_clip_frac"].item() == 1.0
    (grad,) = torch.autograd.grad(loss, v)
    assert grad.tolist() == [[0.0, 0.0]]


def test_unclipped_value_loss_gradient():
    # inside the clip range: d/dV of coef * 0.5 (V - R)^2 / N = coef (V - R) / N
    algo = Algorithm(AlgorithmConfig(advantage="gae", value_clip=0.0, value_loss_coef=0.5))
    v = torch.tensor([[1.9, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = algo.value_loss(v, torch.zeros(1, 2), torch.tensor([[2.0, 5.0]]), mask, LossNormalizer.from_mask(mask))
    (grad,) = torch.autograd.grad(loss, v)
    assert loss.item() == pytest.approx(0.5 * 0.5 * 0.01) and grad.tolist()[0] == pytest.approx([-0.05, 0.0])
    assert algo.needs_critic and not Algorithm(AlgorithmConfig()).needs_critic
