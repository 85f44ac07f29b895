"""Loss aggregation: hand-computed values, and the share property — summing the loss shares of
uneven micro-batches (and of 'ranks') equals the aggregate of the whole global batch."""

import pytest
import torch

from tidal.algorithms import Algorithm, AlgorithmConfig, LossNormalizer, MismatchConfig
from tidal.algorithms.aggregation import ConstantNormalizer, SeqMeanTokenMean, SeqMeanTokenSum, TokenMean

from tests.tolerance import rounding_tol

LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0], [6.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # last row fully masked


def _cfg(**kw):
    return AlgorithmConfig(**kw)


AGGS = {
    "token_mean": (TokenMean(), 21.0 / 6.0),
    "seq_mean_token_mean": (SeqMeanTokenMean(), (2.0 + 4.5 + 6.0) / 3.0),
    "seq_mean_token_sum": (SeqMeanTokenSum(), (6.0 + 9.0 + 6.0) / 3.0),
    "constant": (ConstantNormalizer(_cfg(loss_agg="constant", loss_agg_constant=4.0)), 21.0 / (3.0 * 4.0)),
}


def test_normalizer_counts_tokens_and_nonempty_sequences():
    norm = LossNormalizer.from_mask(MASK)
    assert (norm.num_tokens, norm.num_seqs) == (6.0, 3.0)
    parts = LossNormalizer.from_mask(MASK[:1]) + LossNormalizer.from_mask(MASK[1:])
    assert (parts.num_tokens, parts.num_seqs) == (6.0, 3.0)


@pytest.mark.parametrize("name", sorted(AGGS))
def test_whole_batch_value_by_hand(name):
    agg, expected = AGGS[name]
    got = agg(LOSS, MASK, LossNormalizer.from_mask(MASK))
    assert got.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("name", sorted(AGGS))
@pytest.mark.parametrize("splits", [[1, 3], [3, 1], [1, 1, 2], [2, 2]])
def test_sum_of_micro_batch_shares_equals_global(name, splits):
    agg, expected = AGGS[name]
    norm = LossNormalizer.from_mask(MASK)
    shares = [agg(lb, mb, norm) for lb, mb in zip(LOSS.split(splits), MASK.split(splits))]
    assert sum(shares).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
def test_full_actor_loss_shares_sum_to_whole_batch(loss_agg):
    """The whole actor loss (policy term + KL loss + entropy bonus + IS weights) and its gradient:
    rank 0 holds rows 0-2 in micro-batches [1, 2], rank 1 holds rows 3-5 in [2, 1]; the summed
    shares and gradients equal those of the whole batch in one call."""
    torch.manual_seed(0)
    kw = {"loss_agg_constant": 5.0} if loss_agg == "constant" else {}
    algo = Algorithm(
        AlgorithmConfig(loss_agg=loss_agg, kl_coef=0.05, entropy_coef=0.01, mismatch=MismatchConfig(mode="token_truncate"), **kw)
    )
    B, T = 6, 5
    mask = torch.tensor(
        [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]],
        dtype=torch.float32,
    )
    logp = (-torch.rand(B, T) * 2).requires_grad_(True)
    old, ref, rollout = (logp.detach() + 0.3 * torch.randn(B, T) for _ in range(3))
    adv, ent = torch.randn(B, T), torch.rand(B, T)
    norm = LossNormalizer.from_mask(mask[:3]) + LossNormalizer.from_mask(mask[3:])  # "all-reduced" over 2 ranks

    def run(rows):
        s = slice(*rows)
        return algo.policy_loss(
            logp[s], old[s], adv[s], mask[s], norm, ref_logp_BT=ref[s], rollout_logp_BT=rollout[s], entropy_BT=ent[s]
        )

    whole, whole_m = run((0, 6))
    (g_whole,) = torch.autograd.grad(whole, logp)
    parts = [run(r) for r in [(0, 1), (1, 3), (3, 5), (5, 6)]]
    total = sum(p[0] for p in parts)
    (g_parts,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(whole.item(), abs=rounding_tol(torch.float32, whole))
    torch.testing.assert_close(g_parts, g_whole, rtol=0, atol=rounding_tol(torch.float32, g_whole))
    # metrics are micro-batch means: weighted by the micro-batch's response tokens (per-token
    # metrics; loss metrics of token_mean) or sequences (loss metrics of the seq modes) they give
    # the whole-batch metric
    rows = [(0, 1), (1, 3), (3, 5), (5, 6)]
    tokens = [mask[a:b].sum().item() for a, b in rows]
    seqs = [(mask[a:b].sum(-1) > 0).sum().item() for a, b in rows]
    loss_w = tokens if loss_agg == "token_mean" else seqs
    per_token = ("clip_frac", "approx_kl", "kl", "entropy", "mismatch_kl", "mismatch_is_weight", "mismatch_abs_logp_diff")
    for key in per_token + ("pg_loss", "kl_loss", "loss"):
        w = tokens if key in per_token else loss_w
        mean = sum(p[1][key].item() * wi for p, wi in zip(parts, w)) / sum(w)
        assert mean == pytest.approx(whole_m[key].item(), rel=1e-5, abs=1e-7), key
    assert whole_m["loss"].item() == pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_value_loss_shares_sum_to_whole_batch(loss_agg):
    torch.manual_seed(1)
    algo = Algorithm(AlgorithmConfig(advantage="gae", loss_agg=loss_agg))
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.float32)
    v, old, ret = torch.randn(3, 3), torch.randn(3, 3), torch.randn(3, 3)
    norm = LossNormalizer.from_mask(mask)
    whole, _ = algo.value_loss(v, old, ret, mask, norm)
    parts = [algo.value_loss(v[s], old[s], ret[s], mask[s], norm)[0] for s in (slice(0, 2), slice(2, 3))]
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)
