"""Policy losses against hand-computed values and gradients (token_mean unless stated)."""

import math

import pytest
import torch

from tidal.algorithms import AlgorithmConfig, CPGDConfig, LossNormalizer
from tidal.algorithms.aggregation import SeqMeanTokenMean, TokenMean
from tidal.algorithms.losses.cispo import CISPO
from tidal.algorithms.losses.cpgd import CPGDLoss
from tidal.algorithms.losses.gmpo import GMPO
from tidal.algorithms.losses.gspo import GSPO
from tidal.algorithms.losses.ppo_clip import PPOClip


def _run(loss_fn, log_ratio, adv, agg=None, mask=None, weight=None):
    """logp is a leaf at 0 (arbitrary); old = logp - log_ratio. Returns (loss, metrics, dloss/dlogp)."""
    log_ratio = torch.tensor(log_ratio, dtype=torch.float64)
    adv = torch.tensor(adv, dtype=torch.float64)
    mask = torch.ones_like(log_ratio) if mask is None else torch.tensor(mask, dtype=torch.float64)
    logp = torch.full_like(log_ratio, -1.0).requires_grad_(True)
    old = logp.detach() - log_ratio
    norm = LossNormalizer.from_mask(mask)
    loss, metrics = loss_fn(logp, old, adv, mask, agg or TokenMean(), norm, weight_BT=weight)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), metrics, grad


L = math.log


def _close(t, expected):
    return torch.allclose(t, torch.tensor(expected, dtype=t.dtype), atol=1e-9, rtol=1e-7)


def test_ppo_decoupled_clip_by_hand():
    # clip range [0.8, 1.28]; ratios 1.5, .5, 1.5, .5 with A = 1, 1, -1, -1
    # losses: max(-1.5, -1.28) = -1.28 (clipped), max(-.5, -.8) = -.5, max(1.5, 1.28) = 1.5, max(.5, .8) = .8 (clipped)
    fn = PPOClip(AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    loss, m, grad = _run(fn, [[L(1.5), L(0.5), L(1.5), L(0.5)]], [[1.0, 1.0, -1.0, -1.0]])
    assert loss == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    # d/dlogp of -A r / N where unclipped, 0 where clipped
    assert _close(grad, [[0.0, -0.5 / 4, 1.5 / 4, 0.0]])
    assert m["pg_loss"].item() == pytest.approx(loss)
    k3 = [r - 1 - L(r) for r in (1.5, 0.5, 1.5, 0.5)]
    assert m["approx_kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    # A = -1: r = 5 -> max(5, 1.2) = 5 > c = 3 -> 3 (no gradient); r = 2 -> 2 < 3 stays (gradient -A r / N = 1)
    # A = +1, r = 5: clipped to -1.2, dual-clip does not touch positive advantages
    fn = PPOClip(AlgorithmConfig(dual_clip=3.0))
    loss, m, grad = _run(fn, [[L(5.0), L(2.0), L(5.0)]], [[-1.0, -1.0, 1.0]])
    assert loss == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert _close(grad, [[0.0, 2.0 / 3, 0.0]])
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)


def test_ppo_weight_scales_each_token():
    fn = PPOClip(AlgorithmConfig())
    loss, _, grad = _run(fn, [[0.0, 0.0]], [[1.0, 2.0]], weight=torch.tensor([[0.5, 0.0]], dtype=torch.float64))
    assert loss == pytest.approx((-0.5 + 0.0) / 2)
    assert _close(grad, [[-0.25, 0.0]])


def test_gspo_sequence_ratio_by_hand():
    # one sequence, log-ratios [.1, .3] -> s = exp(.2); A = 1; seq_mean_token_mean: loss = -s,
    # d/dlogp_t = -s / 2 (the gradient of -A exp(mean_t log r_t))
    s = math.exp(0.2)
    loss, m, grad = _run(GSPO(AlgorithmConfig(clip_low=0.3, clip_high=0.3)), [[0.1, 0.3]], [[1.0, 1.0]], SeqMeanTokenMean())
    assert loss == pytest.approx(-s)
    assert _close(grad, [[-s / 2, -s / 2]])
    assert m["clip_frac"].item() == 0.0
    # the same sequence with clip_high .1: s > 1.1 with A > 0 -> clipped at -1.1, no gradient
    loss, m, grad = _run(GSPO(AlgorithmConfig(clip_low=0.1, clip_high=0.1)), [[0.1, 0.3]], [[1.0, 1.0]], SeqMeanTokenMean())
    assert loss == pytest.approx(-1.1) and grad.abs().sum() == 0 and m["clip_frac"].item() == 1.0


def test_gspo_ignores_padding_in_sequence_ratio():
    s = math.exp(0.2)
    loss, _, _ = _run(GSPO(AlgorithmConfig(clip_low=0.3, clip_high=0.3)), [[0.1, 0.3, 5.0]], [[1.0, 1.0, 1.0]],
                      SeqMeanTokenMean(), mask=[[1.0, 1.0, 0.0]])
    assert loss == pytest.approx(-s)


def test_gmpo_geometric_mean_by_hand():
    # A = +1, log-ratios [.1, .5], log-clip .4: pessimistic [.1, .4] -> ratio exp(.25), loss -exp(.25);
    # d/dlogp_0 = -exp(.25) / 2, token 1 clipped -> 0
    # A = -1, log-ratios [-.5, .1]: pessimistic (larger ratio) [-.4, .1] -> loss +exp(-.15); token 0 clipped
    cfg = AlgorithmConfig(policy_loss="gmpo", clip_low=0.4, clip_high=0.4)
    loss, m, grad = _run(GMPO(cfg), [[0.1, 0.5], [-0.5, 0.1]], [[1.0, 1.0], [-1.0, -1.0]], SeqMeanTokenMean())
    assert loss == pytest.approx((-math.exp(0.25) + math.exp(-0.15)) / 2)
    assert _close(grad, [[-math.exp(0.25) / 4, 0.0], [0.0, math.exp(-0.15) / 4]])
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_cispo_keeps_gradient_of_clipped_tokens():
    # clip_low 1 (no lower bound), clip_high .28: w = [1.28, .5]; loss tokens -w A = [-1.28, .5]
    # gradient -w A / N even for the clipped token 0 (unlike PPO)
    cfg = AlgorithmConfig(policy_loss="cispo", clip_low=1.0, clip_high=0.28)
    loss, m, grad = _run(CISPO(cfg), [[L(1.5), L(0.5)]], [[1.0, -1.0]])
    assert loss == pytest.approx((-1.28 + 0.5) / 2)
    assert _close(grad, [[-1.28 / 2, 0.5 / 2]])
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_cpgd_loss_by_hand():
    # A = [1, -1], d = [.3, .1], clip [log .8, log 1.2]:
    #   token 0: -min(.3, log 1.2) = -log 1.2 (clipped, no pg gradient); token 1: -min(-.1, -.1) = .1
    #   drift k3: e^d - 1 - d ; alpha .1 ; d drift / dd = e^d - 1
    cfg = AlgorithmConfig(policy_loss="cpgd", cpgd=CPGDConfig(drift_coef=0.1))
    loss, m, grad = _run(CPGDLoss(cfg), [[0.3, 0.1]], [[1.0, -1.0]])
    drift = [math.exp(d) - 1 - d for d in (0.3, 0.1)]
    pg = (-L(1.2) + 0.1) / 2
    assert m["pg_loss"].item() == pytest.approx(pg)
    assert loss == pytest.approx(pg + 0.1 * sum(drift) / 2)
    assert _close(grad, [[0.1 * (math.exp(0.3) - 1) / 2, 0.5 + 0.1 * (math.exp(0.1) - 1) / 2]])
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_cpgd_gradient_is_policy_gradient_inside_clip():
    # small log-ratio, no drift: grad = -A / N (no ratio factor, unlike PPO's -A r / N)
    cfg = AlgorithmConfig(policy_loss="cpgd", cpgd=CPGDConfig(drift_coef=0.0))
    _, _, grad = _run(CPGDLoss(cfg), [[0.05, -0.05]], [[2.0, 3.0]])
    assert _close(grad, [[-1.0, -1.5]])
