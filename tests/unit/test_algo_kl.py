"""KL estimators, KL as a loss or in the reward, fixed and adaptive controllers."""

import math

import pytest
import torch

from tidal.algorithms import Algorithm, AlgorithmConfig, LossNormalizer


@pytest.mark.parametrize(
    "name, expected",
    [("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) - 1 + 0.5)],  # log pi - log pi_ref = .5
)
def test_estimators_by_hand(name, expected):
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator=name))
    assert algo.token_kl(torch.tensor([-1.0]), torch.tensor([-1.5])).item() == pytest.approx(expected, rel=1e-6)


def test_k3_is_nonnegative_and_k1_can_be_negative():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    assert (Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator="k3")).token_kl(logp, ref) >= 0).all()
    assert Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator="k1")).token_kl(logp, ref)[1] < 0


def test_no_reference_without_kl():
    assert not Algorithm(AlgorithmConfig()).needs_reference
    assert Algorithm(AlgorithmConfig(kl_coef=0.01)).needs_reference


def test_kl_loss_term_and_gradient():
    # logp == old (ratio 1), A = 0: the loss is only beta * mean_t k3; d k3 / d logp = 1 - exp(ref - logp)
    algo = Algorithm(AlgorithmConfig(kl_coef=0.5, kl_estimator="k3"))
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    loss, m = algo.policy_loss(logp, logp.detach(), torch.zeros(1, 2), mask, LossNormalizer.from_mask(mask), ref_logp_BT=ref)
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 2, rel=1e-6)
    assert m["kl"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    assert m["kl_loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.tolist()[0] == pytest.approx([0.5 * (1 - math.exp(-0.5)) / 2, 0.5 * (1 - math.exp(1.0)) / 2], rel=1e-5)


def test_kl_in_reward_is_not_a_loss_term_but_a_token_reward():
    algo = Algorithm(AlgorithmConfig(kl_coef=0.2, kl_estimator="k1", kl_in_reward=True))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    tok = algo.kl_reward_BT(torch.tensor([[-1.0, -1.0, -2.0]]), torch.tensor([[-3.0, -1.5, -1.0]]), mask)
    assert torch.allclose(tok, torch.tensor([[0.0, -0.2 * 0.5, -0.2 * -1.0]]))
    logp = torch.tensor([[-1.0, -1.0, -2.0]], requires_grad=True)
    loss, m = algo.policy_loss(logp, logp.detach(), torch.zeros(1, 3), mask, LossNormalizer.from_mask(mask),
                               ref_logp_BT=torch.tensor([[-3.0, -1.5, -1.0]]))
    assert loss.item() == 0.0 and "kl_loss" not in m and m["kl"].item() == pytest.approx((0.5 - 1.0) / 2)


def test_kl_loss_requires_reference_logprobs():
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logp_BT"):
        algo.policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                         LossNormalizer(num_tokens=1, num_seqs=1))


def test_fixed_controller_never_moves():
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1))
    algo.update_after_step({"kl": 100.0})
    assert algo.kl_coef == 0.1


def test_adaptive_controller_by_hand():
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_controller="adaptive", kl_target=0.05, kl_horizon_steps=10))
    algo.update_after_step({"kl": 0.1})  # error clipped to +0.2 -> x 1.02
    assert algo.kl_coef == pytest.approx(0.102)
    algo.update_after_step({"kl": 0.045})  # error -0.1 -> x 0.99
    assert algo.kl_coef == pytest.approx(0.102 * 0.99)
    # the updated coefficient is what KL-in-reward and the KL loss use, and it survives a state round-trip
    state = algo.state_dict()
    fresh = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_controller="adaptive", kl_target=0.05, kl_horizon_steps=10))
    fresh.load_state_dict(state)
    assert fresh.kl_coef == pytest.approx(0.102 * 0.99)
    with pytest.raises(KeyError, match="kl"):
        algo.update_after_step({"loss": 1.0})


# ---- kl_clamp: extreme inputs give finite values and gradients --------------------------------------
EXTREME_LOGP = [-math.inf, -1e30, -200.0, -30.0, 0.0]  # against ref_logp = -1: log r = +inf, 1e30, 199, 29, -1


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamp", [10.0, 0.0])
def test_extreme_log_ratios_give_finite_kl_and_gradients(name, clamp):
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator=name, kl_clamp=clamp))
    logp = torch.tensor(EXTREME_LOGP + [-1.0 - 1e30, -1.0 - 25.0], requires_grad=True)  # and log r = -1e30, -25
    kl = algo.token_kl(logp, torch.full_like(logp, -1.0))
    assert torch.isfinite(kl).all(), kl
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert torch.isfinite(grad).all(), grad
    if clamp:
        assert (kl.abs() <= clamp).all()


def test_kl_clamp_bounds_each_token_and_stops_its_gradient():
    logp = torch.tensor([-1.0, -4.0], requires_grad=True)  # log r = 0.5, 3.5 against ref -0.5
    ref = torch.tensor([-0.5, -0.5])
    k3 = lambda lr: math.exp(lr) - 1 - lr  # noqa: E731
    clamped = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator="k3", kl_clamp=10.0)).token_kl(logp, ref)
    assert clamped.tolist() == pytest.approx([k3(0.5), 10.0])  # k3(3.5) = 28.6 > 10
    (grad,) = torch.autograd.grad(clamped.sum(), logp)
    assert grad.tolist() == pytest.approx([1 - math.exp(0.5), 0.0])
    unclamped = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator="k3", kl_clamp=0.0)).token_kl(logp, ref)
    assert unclamped.tolist() == pytest.approx([k3(0.5), k3(3.5)], rel=1e-6)
    wide = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_clamp=2.0)).token_kl(logp, ref)
    assert wide.tolist() == pytest.approx([-0.5, -2.0])  # k1 = log pi - log pi_ref, clamped to [-2, 2]


def test_kl_clamp_is_validated():
    from tidal.config_base import ConfigError

    with pytest.raises(ConfigError, match="kl_clamp"):
        AlgorithmConfig(kl_coef=0.1, kl_clamp=-1.0)
    with pytest.raises(ConfigError, match="'kl_clamp': only used with kl_coef > 0"):
        AlgorithmConfig(kl_clamp=5.0)
