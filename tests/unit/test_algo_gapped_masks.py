"""Non-contiguous action masks (multi-turn rows: observation tokens between the sampled turns).

Every estimator, loss, aggregation mode, KL option, entropy term and mismatch correction must give
on a gapped row exactly what it gives on the same sampled tokens laid out contiguously (values at
the gap positions are garbage that must not leak), plus hand-computed cases for the recursions
(returns-to-go, GAE) and per-turn rewards, and trajectories split over several rows.
"""

import itertools

import pytest
import torch

from tidal.algorithms import AdvantageInput, Algorithm, AlgorithmConfig, CPGDConfig, LossNormalizer, MismatchConfig
from tidal.algorithms.config import OverlongConfig
from tidal.algorithms.advantages.common import returns_to_go

ESTIMATORS = ["gae", "grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce_pp_baseline", "cpgd"]


def _adv(cfg: AlgorithmConfig, **inp):
    return Algorithm(cfg).compute_advantages(AdvantageInput(**inp))


# ---- hand-computed -----------------------------------------------------------------------------
def test_returns_to_go_skips_observation_tokens_by_hand():
    # prompt, turn 1 (2 tokens), observation (2 tokens), turn 2 (1 token), padding; gamma 0.5.
    # Sampled tokens k = 0, 1, 2 at positions 1, 2, 5; r = 1 at the last one:
    # G = [.25, .5, 1] on them (a reset at the gap would give 0, 0, 1).
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 0]])
    r = torch.tensor([[9.0, 0, 0, 7, 7, 1, 5]])  # values off the mask are ignored
    assert torch.allclose(returns_to_go(r, mask, 0.5), torch.tensor([[0.0, 0.25, 0.5, 0, 0, 1, 0]]))


def test_gae_bootstraps_across_the_observation_by_hand():
    # Sampled tokens at 1, 2 (turn 1) and 5 (turn 2); gamma 1, lam .5; V = .5, .4, .3; reward 1.
    #   d(5) = 1 - .3 = .7;  d(2) = V(5) - V(2) = .3 - .4 = -.1;  d(1) = .4 - .5 = -.1
    #   A(5) = .7;  A(2) = -.1 + .5 * .7 = .25;  A(1) = -.1 + .5 * .25 = .025
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 0]])
    values = torch.tensor([[3.0, 0.5, 0.4, 8.0, 8.0, 0.3, 2.0]])
    adv, ret = _adv(AlgorithmConfig(advantage="gae", lam=0.5), rewards_B=torch.tensor([1.0]), action_mask_BT=mask,
                    group_ids_B=torch.tensor([0]), values_BT=values)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.025, 0.25, 0, 0, 0.7, 0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.0, 0.525, 0.65, 0, 0, 1.0, 0]]), atol=1e-6)


def test_per_turn_rewards_by_hand():
    # Turn 1 (positions 1, 2) earns a per-turn reward .5 at its last token; the outcome 1 is at the
    # trajectory's last sampled token (5). reinforce, gamma 1: G = 1.5 on turn 1, 1 on turn 2.
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1]])
    turn_r = torch.tensor([[0.0, 0, 0.5, 0, 0, 0]])
    adv, _ = _adv(AlgorithmConfig(advantage="reinforce"), rewards_B=torch.tensor([1.0]), action_mask_BT=mask,
                  group_ids_B=torch.tensor([0]), token_rewards_BT=turn_r)
    assert torch.allclose(adv, torch.tensor([[0.0, 1.5, 1.5, 0, 0, 1.0]]))
    # gamma .5 over sampled tokens: G(5) = 1, G(2) = .5 + .5 * 1 = 1, G(1) = .5
    adv, _ = _adv(AlgorithmConfig(advantage="reinforce", gamma=0.5), rewards_B=torch.tensor([1.0]), action_mask_BT=mask,
                  group_ids_B=torch.tensor([0]), token_rewards_BT=turn_r)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.5, 1.0, 0, 0, 1.0]]))
    # grpo: group-normalised outcome on every sampled token + the reward-to-go of the turn rewards.
    # Group of two: outcomes 1 and 0 -> A = +-.5 / (std .70711 + eps) = +-.70711
    mask2 = torch.cat([mask, mask])
    adv, _ = _adv(AlgorithmConfig(advantage="grpo"), rewards_B=torch.tensor([1.0, 0.0]), action_mask_BT=mask2,
                  group_ids_B=torch.tensor([0, 0]), token_rewards_BT=torch.cat([turn_r, torch.zeros_like(turn_r)]))
    a = 0.5**0.5
    assert torch.allclose(adv, torch.tensor([[0.0, a + 0.5, a + 0.5, 0, 0, a], [0.0, -a, -a, 0, 0, -a]]), atol=1e-5)


# ---- gapped == contiguous ------------------------------------------------------------------------
def _gapped_and_contiguous(seed: int, B: int = 4, turns: int = 3):
    """(gapped, contiguous, sampled positions): per row a prompt, then ``turns`` turns of random
    length separated by observations of random length, then padding. Per-token tensors hold
    random values everywhere (garbage off the mask)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        layout = [0] * int(torch.randint(1, 3, (1,), generator=g))
        for k in range(turns):
            layout += [1] * int(torch.randint(1, 4, (1,), generator=g))
            if k < turns - 1:
                layout += [0] * int(torch.randint(1, 4, (1,), generator=g))
        rows.append(layout)
    T = max(len(r) for r in rows) + 2
    gapped = torch.zeros(B, T)
    for b, r in enumerate(rows):
        gapped[b, : len(r)] = torch.tensor(r, dtype=torch.float32)
    n_B = gapped.sum(-1).long()
    contiguous = (torch.arange(T)[None, :] < n_B[:, None]).float()
    pos = [gapped[b].nonzero().squeeze(-1) for b in range(B)]
    return gapped, contiguous, pos


def _to_contiguous(x_BT: torch.Tensor, pos) -> torch.Tensor:
    """The sampled-token values of a gapped tensor packed to the left, garbage (7.0) after."""
    out = torch.full_like(x_BT, 7.0)
    for b, p in enumerate(pos):
        out[b, : len(p)] = x_BT[b, p]
    return out


def _sampled(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> list[torch.Tensor]:
    return [x_BT[b][mask_BT[b].bool()] for b in range(x_BT.shape[0])]


def _assert_same_on_sampled(x_gapped, mask_gapped, x_contig, mask_contig, atol=1e-5):
    for a, b in zip(_sampled(x_gapped, mask_gapped), _sampled(x_contig, mask_contig)):
        assert torch.allclose(a, b, atol=atol), (a, b)
    assert (x_gapped * (1 - mask_gapped)).abs().sum() == 0


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("adv_norm", ["none", "batch"])
def test_estimators_gapped_equal_contiguous(estimator, adv_norm):
    if adv_norm == "batch" and estimator.startswith("reinforce_pp"):
        pytest.skip("reinforce_pp whitens itself (adv_norm=batch is refused)")
    gapped, contig, pos = _gapped_and_contiguous(0)
    B, T = gapped.shape
    torch.manual_seed(1)
    values, tok_r = torch.randn(B, T), 0.1 * torch.randn(B, T)
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.tensor([0, 0, 1, 1])
    gamma = 0.9 if estimator in ("gae", "reinforce", "reinforce_pp", "reinforce_pp_baseline") else 1.0
    cfg = AlgorithmConfig(advantage=estimator, gamma=gamma, lam=0.8 if estimator == "gae" else 0.95, adv_norm=adv_norm)
    common = dict(rewards_B=rewards, group_ids_B=groups, values_BT=values if estimator == "gae" else None)
    adv_g, ret_g = _adv(cfg, action_mask_BT=gapped, token_rewards_BT=tok_r, **common)
    adv_c, ret_c = _adv(cfg, action_mask_BT=contig, token_rewards_BT=_to_contiguous(tok_r, pos),
                        **dict(common, values_BT=_to_contiguous(values, pos) if estimator == "gae" else None))
    _assert_same_on_sampled(adv_g, gapped, adv_c, contig)
    _assert_same_on_sampled(ret_g, gapped, ret_c, contig)


LOSS_CASES = [
    # (policy_loss, mismatch modes that apply to it)
    ("ppo_clip", ["none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"]),
    ("cispo", ["none", "token_truncate", "seq_mask"]),
    ("cpgd", ["none", "token_mask", "seq_truncate"]),
    ("gspo", ["none", "seq_truncate", "seq_mask"]),
    ("gmpo", ["none", "seq_truncate", "seq_mask"]),
]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"]


def _loss_cases():
    for (loss, modes), agg in itertools.product(LOSS_CASES, AGGS):
        for mode in modes:
            yield loss, agg, mode


def _policy_loss(cfg, mask, logp, old, adv, ref, rollout, entropy):
    logp = logp.clone().requires_grad_(True)
    entropy = entropy.clone().requires_grad_(True)
    loss, metrics = Algorithm(cfg).policy_loss(logp, old, adv, mask, LossNormalizer.from_mask(mask), ref_logp_BT=ref,
                                               rollout_logp_BT=rollout, entropy_BT=entropy)
    g_logp, g_ent = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return loss, metrics, g_logp, g_ent


@pytest.mark.parametrize("policy_loss, loss_agg, mode", list(_loss_cases()))
def test_losses_gapped_equal_contiguous(policy_loss, loss_agg, mode):
    """Loss value, every metric, and the gradients w.r.t. logp and entropy on sampled tokens (0
    elsewhere), with KL as a loss, an entropy bonus and the mismatch correction all on."""
    gapped, contig, pos = _gapped_and_contiguous(2)
    B, T = gapped.shape
    torch.manual_seed(3)
    old = -torch.rand(B, T) - 0.5
    logp = old + 0.3 * torch.randn(B, T)
    rollout = old + 0.3 * torch.randn(B, T)
    ref = old + 0.3 * torch.randn(B, T)
    entropy = torch.rand(B, T)
    adv = torch.randn(B, 1).expand(B, T).contiguous()  # sequence-level advantages (gspo/gmpo expect them)
    adv = adv + 0.1 * torch.randn(B, T) * (policy_loss not in ("gspo", "gmpo"))
    cfg = AlgorithmConfig(
        policy_loss=policy_loss, loss_agg=loss_agg, loss_agg_constant=16.0 if loss_agg == "constant" else 0.0,
        clip_low=0.2 if policy_loss != "cispo" else 1.0, kl_coef=0.05, entropy_coef=0.01,
        mismatch=MismatchConfig(mode=mode, cap=1.3 if mode != "none" else 2.0, lower=0.8 if mode.endswith("_mask") else 0.0),
    )
    tensors = dict(logp=logp, old=old, adv=adv, ref=ref, rollout=rollout, entropy=entropy)
    loss_g, m_g, gl_g, ge_g = _policy_loss(cfg, gapped, **tensors)
    loss_c, m_c, gl_c, ge_c = _policy_loss(cfg, contig, **{k: _to_contiguous(v, pos) for k, v in tensors.items()})
    assert loss_g.item() == pytest.approx(loss_c.item(), rel=1e-5, abs=1e-7)
    assert m_g.keys() == m_c.keys()
    for k in m_g:
        assert m_g[k].item() == pytest.approx(m_c[k].item(), rel=1e-5, abs=1e-7), k
    _assert_same_on_sampled(gl_g, gapped, gl_c, contig, atol=1e-7)
    _assert_same_on_sampled(ge_g, gapped, ge_c, contig, atol=1e-7)
    assert ge_g.abs().sum() > 0  # the entropy bonus has a gradient


@pytest.mark.parametrize("top_q", [0.5])
def test_high_entropy_selection_gapped_equal_contiguous(top_q):
    gapped, contig, pos = _gapped_and_contiguous(4)
    B, T = gapped.shape
    torch.manual_seed(5)
    old = -torch.rand(B, T) - 0.5
    t = dict(logp=old + 0.2 * torch.randn(B, T), old=old, adv=torch.randn(B, T), ref=old, rollout=old,
             entropy=torch.rand(B, T) + 10 * (1 - gapped))  # high entropy off the mask must not be selected
    cfg = AlgorithmConfig(entropy_top_q=top_q)
    loss_g, m_g, gl_g, _ = _policy_loss(cfg, gapped, **t)
    loss_c, m_c, gl_c, _ = _policy_loss(cfg, contig, **{k: _to_contiguous(v, pos) for k, v in t.items()})
    assert loss_g.item() == pytest.approx(loss_c.item(), rel=1e-6)
    assert m_g["entropy_selected_frac"].item() == pytest.approx(m_c["entropy_selected_frac"].item())
    _assert_same_on_sampled(gl_g, gapped, gl_c, contig, atol=1e-7)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_value_loss_gapped_equal_contiguous(loss_agg):
    gapped, contig, pos = _gapped_and_contiguous(6)
    B, T = gapped.shape
    torch.manual_seed(7)
    v, old_v, ret = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    cfg = AlgorithmConfig(advantage="gae", loss_agg=loss_agg, loss_agg_constant=16.0 if loss_agg == "constant" else 0.0)

    def run(mask, v, old_v, ret):
        v = v.clone().requires_grad_(True)
        loss, m = Algorithm(cfg).value_loss(v, old_v, ret, mask, LossNormalizer.from_mask(mask))
        return loss, m, torch.autograd.grad(loss, v)[0]

    loss_g, m_g, g_g = run(gapped, v, old_v, ret)
    loss_c, m_c, g_c = run(contig, *(_to_contiguous(x, pos) for x in (v, old_v, ret)))
    assert loss_g.item() == pytest.approx(loss_c.item(), rel=1e-6)
    for k in m_g:
        assert m_g[k].item() == pytest.approx(m_c[k].item(), rel=1e-5, abs=1e-7), k
    _assert_same_on_sampled(g_g, gapped, g_c, contig, atol=1e-7)


def test_normalizer_and_kl_reward_gapped():
    gapped, contig, _ = _gapped_and_contiguous(8)
    assert LossNormalizer.from_mask(gapped) == LossNormalizer.from_mask(contig)
    algo = Algorithm(AlgorithmConfig(kl_coef=0.1, kl_in_reward=True))
    kl = algo.kl_reward_BT(torch.randn(gapped.shape), torch.randn(gapped.shape), gapped)
    assert (kl * (1 - gapped)).abs().sum() == 0 and (kl * gapped).abs().sum() > 0


# ---- trajectories split over rows ---------------------------------------------------------------
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_trajectory_split_over_rows_equals_one_row(estimator):
    """Trajectory 0 = rows 0 and 1 (turn 1, then turn 2 behind a re-rendered prompt); trajectory 1
    is one row. The advantages equal those of the same trajectories written as one gapped row
    each, and the group statistics count trajectory 0 once."""
    # one-row form: [p, a, a, o, o, b, b] and [p, c, c, c, pad, pad, pad]
    one = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1], [0.0, 1, 1, 1, 0, 0, 0]])
    # split form (T = 7): row 0 = [p, a, a, pad...], row 1 = [p', p', p', b, b, pad, pad], row 2 = traj 1
    split = torch.tensor([[0.0, 1, 1, 0, 0, 0, 0], [0.0, 0, 0, 1, 1, 0, 0], [0.0, 1, 1, 1, 0, 0, 0]])
    torch.manual_seed(9)
    val_one, tr_one = torch.randn(2, 7), 0.1 * torch.randn(2, 7)
    val_split, tr_split = torch.zeros(3, 7), torch.zeros(3, 7)
    val_split[0, 1:3], val_split[1, 3:5], val_split[2] = val_one[0, 1:3], val_one[0, 5:7], val_one[1]
    tr_split[0, 1:3], tr_split[1, 3:5], tr_split[2] = tr_one[0, 1:3], tr_one[0, 5:7], tr_one[1]
    gamma = 0.9 if estimator in ("gae", "reinforce", "reinforce_pp", "reinforce_pp_baseline") else 1.0
    cfg = AlgorithmConfig(advantage=estimator, gamma=gamma, lam=0.7 if estimator == "gae" else 0.95)
    use_v = estimator == "gae"
    adv_one, ret_one = _adv(cfg, rewards_B=torch.tensor([1.0, 0.0]), action_mask_BT=one, group_ids_B=torch.tensor([0, 0]),
                            token_rewards_BT=tr_one, values_BT=val_one if use_v else None)
    adv_split, ret_split = _adv(cfg, rewards_B=torch.tensor([1.0, 1.0, 0.0]), action_mask_BT=split,
                                group_ids_B=torch.tensor([0, 0, 0]), token_rewards_BT=tr_split,
                                values_BT=val_split if use_v else None, trajectory_ids_B=torch.tensor([10, 10, 11]))
    for x_one, x_split in ((adv_one, adv_split), (ret_one, ret_split)):
        traj0 = torch.cat([x_split[0][split[0].bool()], x_split[1][split[1].bool()]])
        assert torch.allclose(traj0, x_one[0][one[0].bool()], atol=1e-5)
        assert torch.allclose(x_split[2][split[2].bool()], x_one[1][one[1].bool()], atol=1e-5)
        assert (x_split * (1 - split)).abs().sum() == 0
    if estimator in ("grpo", "rloo"):
        assert adv_split[0, 1] > 0 > adv_split[2, 1]  # a group of two trajectories, not three rows


def test_trajectory_rows_must_share_reward_and_group():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="rewards_B: row 1"):
        _adv(AlgorithmConfig(), rewards_B=torch.tensor([1.0, 0.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0, 0]),
             trajectory_ids_B=torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="group_ids_B: row 1"):
        _adv(AlgorithmConfig(), rewards_B=torch.tensor([1.0, 1.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0, 1]),
             trajectory_ids_B=torch.tensor([3, 3]))


def test_cpgd_clip_filter_weight_counts_trajectories():
    cfg = AlgorithmConfig(advantage="cpgd", cpgd=CPGDConfig(weight="clip_filter_like"))
    mask = torch.ones(3, 2)
    adv, _ = _adv(cfg, rewards_B=torch.tensor([1.0, 1.0, 0.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0, 0, 0]),
                  trajectory_ids_B=torch.tensor([0, 0, 1]))
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, 0.5, -0.5]))  # mean over 2 trajectories = .5


# ---- Algorithm.advantages with multi-turn inputs ------------------------------------------------------
def _facade(cfg, **kw):
    algo = Algorithm(cfg)
    base = dict(truncated_B=torch.zeros(kw["total_B"].shape[0], dtype=torch.bool), old_logp_BT=None, ref_logp_BT=None,
                values_BT=None)
    return algo, algo.advantages(**{**base, **kw})


def test_advantages_add_per_turn_rewards_to_the_kl_rewards():
    """token_rewards_BT (per-turn rewards) and the KL-in-reward penalty both enter the estimator."""
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 1]])
    turn_r = torch.tensor([[0.0, 0, 0.5, 0, 0, 0]])
    old, ref = torch.full((1, 6), -1.0), torch.full((1, 6), -1.2)
    cfg = AlgorithmConfig(advantage="reinforce", kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    _, both = _facade(cfg, total_B=torch.tensor([1.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0]),
                      old_logp_BT=old, ref_logp_BT=ref, token_rewards_BT=turn_r)
    _, kl_only = _facade(cfg, total_B=torch.tensor([1.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0]),
                         old_logp_BT=old, ref_logp_BT=ref)
    # returns-to-go (gamma 1): the per-turn 0.5 reaches the tokens of turn 1 only
    assert torch.allclose(both.returns_BT - kl_only.returns_BT, torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0]]))


def test_reward_processing_sees_each_trajectory_once():
    """With trajectory_ids_B, running normalisation counts trajectory 0 (two rows) once, and the
    overlong shaping reads response_len_B."""
    cfg = AlgorithmConfig(reward_norm="running")
    mask = torch.ones(3, 2)
    algo, res = _facade(cfg, total_B=torch.tensor([1.0, 1.0, 3.0]), action_mask_BT=mask, group_ids_B=torch.tensor([0, 0, 1]),
                        trajectory_ids_B=torch.tensor([0, 0, 1]))
    assert algo.reward_moments.count == 2 and res.rewards_B[0] == res.rewards_B[1]
    shaped = AlgorithmConfig(overlong=OverlongConfig(buffer_len=4, max_len=8))
    _, res = _facade(shaped, total_B=torch.zeros(2), action_mask_BT=torch.ones(2, 2), group_ids_B=torch.tensor([0, 1]),
                     response_len_B=torch.tensor([2.0, 6.0]))
    assert res.metrics["overlong_penalty"] == pytest.approx(-0.25)  # (4 - 6) / 4 on the second, 0 on the first
