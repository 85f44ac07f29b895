"""Advantage estimators against hand-computed values and independent float64 formulas."""

import math

import pytest
import torch

from tidal.algorithms import Algorithm, AlgorithmConfig, AdvantageInput, CPGDConfig


def _adv(cfg: AlgorithmConfig, **inp):
    return Algorithm(cfg).compute_advantages(AdvantageInput(**inp))


# ---- GAE ----------------------------------------------------------------------------------
def test_gae_by_hand():
    # row 0: prompt token then 3 response tokens, gamma 1, lam 0.9, reward 1 at the end.
    #   d3 = 1 - .3 = .7; d2 = .3 - .4 = -.1; d1 = .4 - .5 = -.1
    #   A3 = .7; A2 = -.1 + .9*.7 = .53; A1 = -.1 + .9*.53 = .377; R = A + V
    mask = torch.tensor([[0.0, 1, 1, 1]])
    values = torch.tensor([[7.0, 0.5, 0.4, 0.3]])  # value at the prompt position is ignored
    adv, ret = _adv(AlgorithmConfig(advantage="gae", lam=0.9), rewards_B=torch.tensor([1.0]), action_mask_BT=mask,
                    group_ids_B=torch.tensor([0]), values_BT=values)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.377, 0.53, 0.7]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.0, 0.877, 0.93, 1.0]]), atol=1e-6)


def test_gae_discount_token_rewards_and_padding_by_hand():
    # gamma .9, lam .5; response = first two tokens, padding carries garbage that must not leak.
    #   r = [-.1, -.2 + 2] ; d1 = 1.8 - .6 = 1.2 ; d0 = -.1 + .9*.6 - .2 = .24 ; A0 = .24 + .45*1.2 = .78
    mask = torch.tensor([[1.0, 1, 0, 0]])
    adv, ret = _adv(AlgorithmConfig(advantage="gae", gamma=0.9, lam=0.5), rewards_B=torch.tensor([2.0]),
                    action_mask_BT=mask, group_ids_B=torch.tensor([0]), values_BT=torch.tensor([[0.2, 0.6, 9.0, 9.0]]),
                    token_rewards_BT=torch.tensor([[-0.1, -0.2, 5.0, 5.0]]))
    assert torch.allclose(adv, torch.tensor([[0.78, 1.2, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.98, 1.8, 0.0, 0.0]]), atol=1e-6)


def test_gae_matches_sum_of_discounted_deltas():
    """A_t = sum_l (gamma lam)^l delta_{t+l}, computed per row over its response span in float64."""
    torch.manual_seed(0)
    gamma, lam = 0.95, 0.8
    starts, lens, T = [1, 3, 0], [4, 2, 6], 7
    mask = torch.zeros(3, T)
    for b, (s, n) in enumerate(zip(starts, lens)):
        mask[b, s:s + n] = 1
    values, tok_r, rewards = torch.randn(3, T), 0.1 * torch.randn(3, T), torch.randn(3)
    adv, ret = _adv(AlgorithmConfig(advantage="gae", gamma=gamma, lam=lam), rewards_B=rewards, action_mask_BT=mask,
                    group_ids_B=torch.arange(3), values_BT=values, token_rewards_BT=tok_r)
    for b, (s, n) in enumerate(zip(starts, lens)):
        v = values[b, s:s + n].double().tolist() + [0.0]
        r = tok_r[b, s:s + n].double().tolist()
        r[-1] += float(rewards[b])
        deltas = [r[t] + gamma * v[t + 1] - v[t] for t in range(n)]
        want = [sum((gamma * lam) ** l * deltas[t + l] for l in range(n - t)) for t in range(n)]
        assert adv[b, s:s + n].tolist() == pytest.approx(want, abs=1e-5)
        assert ret[b, s:s + n].tolist() == pytest.approx([a + vv for a, vv in zip(want, v)], abs=1e-5)
    assert (adv * (1 - mask)).abs().sum() == 0


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        _adv(AlgorithmConfig(advantage="gae"), rewards_B=torch.ones(1), action_mask_BT=torch.ones(1, 2),
             group_ids_B=torch.zeros(1))


# ---- group baselines ------------------------------------------------------------------------
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 3.0])
GROUPS = torch.tensor([5, 5, 5, 5, 8, 8, 2])  # group 5: mixed, 8: all equal, 2: a single sample
MASK = torch.tensor([[0.0, 1, 1]] * 7)


def _seq_adv(name, **kw):
    adv, ret = _adv(AlgorithmConfig(advantage=name, **kw), rewards_B=REWARDS, action_mask_BT=MASK, group_ids_B=GROUPS)
    assert torch.equal(adv[:, 0], torch.zeros(7)) and torch.equal(adv[:, 1], adv[:, 2])
    assert torch.equal(ret, adv)
    return adv[:, 1]


def test_grpo_by_hand():
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 1, 0]
    a = 0.5 / (std + 1e-6)
    assert _seq_adv("grpo").tolist() == pytest.approx([a, -a, a, -a, 0, 0, 0], abs=1e-6)


def test_dr_grpo_has_no_std_scaling():
    assert _seq_adv("dr_grpo").tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0, 0, 0], abs=1e-7)


def test_rloo_is_leave_one_out():
    # r=1: others' mean 1/3 -> 2/3 ; r=0: others' mean 2/3 -> -2/3
    assert _seq_adv("rloo").tolist() == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3, 0, 0, 0], abs=1e-6)


@pytest.mark.parametrize(
    "weight, scale",
    [("std", 1 / (math.sqrt(1 / 3) + 1e-6)), ("equal", 1.0), ("clip_filter_like", 3.0)],  # 3 groups, 1 valid
)
def test_cpgd_weights(weight, scale):
    adv = _seq_adv("cpgd", cpgd=CPGDConfig(weight=weight))
    assert adv.tolist() == pytest.approx([0.5 * scale, -0.5 * scale, 0.5 * scale, -0.5 * scale, 0, 0, 0], abs=1e-6)


def test_cpgd_clip_filter_like_weight_is_groups_over_valid_groups():
    # 2 groups, 1 with reward variance: weight 2 (below the cap 3)
    adv, _ = _adv(AlgorithmConfig(advantage="cpgd", cpgd=CPGDConfig(weight="clip_filter_like")),
                  rewards_B=torch.tensor([1.0, 0.0, 1.0, 1.0]), action_mask_BT=torch.ones(4, 1),
                  group_ids_B=torch.tensor([0, 0, 1, 1]))
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_cpgd_single_group_batch_is_not_zero():
    """Upstream's CPGD normalised over the wrong axis and gave 0 for every sample; one prompt
    group with mixed rewards must give non-zero advantages."""
    adv, _ = _adv(AlgorithmConfig(advantage="cpgd"), rewards_B=torch.tensor([1.0, 0.0, 0.0]),
                  action_mask_BT=torch.ones(3, 2), group_ids_B=torch.tensor([4, 4, 4]))
    assert adv.abs().min() > 0.5


def test_group_advantage_adds_undiscounted_token_reward_to_go():
    # dr_grpo, group [1, 0]: outcome +-0.5; token rewards (KL penalty) [-.1, -.2] on row 0 -> RTG [-.3, -.2]
    tok = torch.tensor([[-0.1, -0.2], [0.0, -0.4]])
    adv, _ = _adv(AlgorithmConfig(advantage="dr_grpo"), rewards_B=torch.tensor([1.0, 0.0]),
                  action_mask_BT=torch.ones(2, 2), group_ids_B=torch.tensor([0, 0]), token_rewards_BT=tok)
    assert torch.allclose(adv, torch.tensor([[0.2, 0.3], [-0.9, -0.9]]), atol=1e-6)


# ---- REINFORCE family -----------------------------------------------------------------------
def test_reinforce_returns_by_hand():
    # gamma .5, r = [-.1, -.1, -.1 + 1]: G2 = .9, G1 = -.1 + .45 = .35, G0 = -.1 + .175 = .075
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])
    tok = torch.tensor([[3.0, -0.1, -0.1, -0.1, 3.0]])
    adv, ret = _adv(AlgorithmConfig(advantage="reinforce", gamma=0.5), rewards_B=torch.tensor([1.0]),
                    action_mask_BT=mask, group_ids_B=torch.tensor([0]), token_rewards_BT=tok)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.075, 0.35, 0.9, 0.0]]), atol=1e-6)
    assert torch.equal(adv, ret)


def _whiten(values):
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_reinforce_pp_whitens_returns_over_batch_tokens():
    # rows: reward 1 (1 token), reward 0 (2 tokens): G tokens [1, 0, 0] -> whitened
    mask = torch.tensor([[1.0, 0], [1, 1]])
    adv, ret = _adv(AlgorithmConfig(advantage="reinforce_pp"), rewards_B=torch.tensor([1.0, 0.0]),
                    action_mask_BT=mask, group_ids_B=torch.tensor([0, 1]))
    w = _whiten([1.0, 0.0, 0.0])  # = [sqrt 2, -1/sqrt 2, -1/sqrt 2]
    assert w[0] == pytest.approx(math.sqrt(2), abs=1e-6)
    assert [adv[0, 0].item(), adv[1, 0].item(), adv[1, 1].item()] == pytest.approx(w, abs=1e-5)
    assert adv[0, 1] == 0 and torch.allclose(ret, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # groups: {r=1 (len 1), r=0 (len 2)} and {r=2 (len 1)}; centred: .5, -.5, 0 ; KL tokens on row 1
    mask = torch.tensor([[1.0, 0], [1, 1], [1, 0]])
    tok = torch.tensor([[0.0, 0.0], [-0.2, -0.1], [0.0, 0.0]])
    adv, ret = _adv(AlgorithmConfig(advantage="reinforce_pp_baseline"), rewards_B=torch.tensor([1.0, 0.0, 2.0]),
                    action_mask_BT=mask, group_ids_B=torch.tensor([0, 0, 1]), token_rewards_BT=tok)
    g = [0.5, -0.5 - 0.2 - 0.1, -0.5 - 0.1, 0.0]  # G per response token, gamma 1
    got = [adv[0, 0], adv[1, 0], adv[1, 1], adv[2, 0]]
    assert [x.item() for x in got] == pytest.approx(_whiten(g), abs=1e-5)
    assert [ret[1, 0].item(), ret[1, 1].item()] == pytest.approx(g[1:3], abs=1e-6)
