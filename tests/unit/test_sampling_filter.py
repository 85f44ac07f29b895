"""The processed distribution has one definition (tidal/sampling_filter.py) that the engine samples
from and the trainer's LM head scores with: hand-computed supports (ties at the top-k and top-p
boundaries, min-p, their order), the trainer's logprobs, entropies and gradients against the
engine's, and a filter that is slightly wrong (k off by one, the top-p boundary token on the wrong
side, no renormalisation) measured as a mismatch far above the 1e-5 the right one meets."""

import math

import pytest
import torch

from tidal.engine.sampler import inverse_cdf, keyed_uniforms, process_logits, sample
from tidal.models.lm_head import head_logprobs
from tidal.sampling_filter import SamplingFilter, processed_logprobs, support_threshold

INF = float("-inf")


def _support(logits, **kw):
    return (process_logits(torch.as_tensor(logits, dtype=torch.float32)[None], kw.pop("temperature", 1.0), **kw)[0] > INF).tolist()


def test_hand_computed_supports_ties_and_order():
    # top-k keeps every token tied with the k-th largest
    assert _support([3.0, 2.0, 2.0, 1.0], top_k=2) == [True, True, True, False]
    assert _support([3.0, 2.0, 1.5, 1.0], top_k=2) == [True, True, False, False]
    # top-p 0.7 over p = [.5, .3, .15, .05]: .5 (mass before 0), .3 (before .5 < .7) stay; .15 (before .8) goes
    lp = math.log
    logits = [lp(0.5), lp(0.3), lp(0.15), lp(0.05)]
    assert _support(logits, top_p=0.7) == [True, True, False, False]
    assert _support(logits, top_p=0.5) == [True, False, False, False]  # before .3 is .5, not below .5
    assert _support(logits, top_p=0.51) == [True, True, False, False]
    # the crossing token's ties stay: p = [.4, .2, .2, .2] at top_p .5 keeps .4 and all three .2
    assert _support([lp(0.4), lp(0.2), lp(0.2), lp(0.2)], top_p=0.5) == [True, True, True, True]
    # min-p 0.25: p >= .25 * .5 = .125 keeps .5, .3, .15
    assert _support(logits, min_p=0.25) == [True, True, True, False]
    # top-p is taken over what top-k kept, renormalised: top_k=2 -> [.625, .375]; top_p .6 keeps the first only
    assert _support(logits, top_k=2, top_p=0.6) == [True, False, False, False]
    assert _support(logits, top_p=0.6) == [True, True, False, False]  # without top-k, .3 is inside .6
    # min-p before top-p: min_p .5 keeps [.5, .3] -> [.625, .375]; top_p .6 then keeps the first only
    assert _support(logits, min_p=0.5, top_p=0.6) == [True, False, False, False]
    # renormalised over the support, temperature first
    got = process_logits(torch.tensor([logits]), 2.0, top_k=2)[0].exp()
    q = torch.tensor([0.5, 0.3]).sqrt()
    torch.testing.assert_close(got[:2], q / q.sum(), rtol=0, atol=1e-6)
    assert got[2:].tolist() == [0.0, 0.0]


def test_the_scored_token_is_always_in_the_support():
    """Scoring a sampled token (labels given) reaches the support down to it: a token the trainer's
    logits put just outside its boundary keeps a finite logprob, and the support of other rows is unchanged."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    f = SamplingFilter(top_k=2)
    thr = support_threshold(logits, f, torch.tensor([2, 0]))
    assert thr.tolist() == [1.0, 2.0]
    head = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(4))
    logp, _ = head_logprobs(logits, head, torch.tensor([2, 0]), sampling=f)
    want0 = 1.0 - torch.logsumexp(torch.tensor([3.0, 2.0, 1.0]), 0)
    want1 = 3.0 - torch.logsumexp(torch.tensor([3.0, 2.0]), 0)
    torch.testing.assert_close(logp, torch.stack([want0, want1]), rtol=0, atol=1e-6)


FILTERS = [SamplingFilter(temperature=0.8, top_k=5), SamplingFilter(top_p=0.9), SamplingFilter(temperature=0.7, top_k=20, top_p=0.8),
           SamplingFilter(min_p=0.05), SamplingFilter(temperature=1.3, top_k=50, min_p=0.02, top_p=0.95)]


def _logits(N=64, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 2
    x[:, :6] = x[:, :6].round()  # exact ties near the top
    x[:, 6:12] = 4.0  # six tied tokens: a top-k of 5 falls inside them
    return x


def _draw(logits, f, seed=1):
    u = torch.from_numpy(keyed_uniforms(seed, torch.arange(len(logits)).numpy(), 3))
    return sample(logits, f.temperature, f.top_k, f.top_p, u, min_p=f.min_p)


@pytest.mark.parametrize("f", FILTERS)
def test_trainer_scores_what_the_engine_sampled(f):
    """The LM head (chunked, with gradients) against the engine's sampler on the same logits: the
    sampled token's logprob within 1e-6, the entropy that of the processed distribution, and the
    gradients those of plain autograd over the masked log-softmax."""
    N, V, H = 64, 300, 300
    logits_NV = _logits(N, V)
    tok_N, engine_logp_N = _draw(logits_NV, f)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():  # the head reproduces the logits: identity weight, zero bias
        head.weight.copy_(torch.eye(V, H))
        head.bias.zero_()
    hidden = logits_NV.clone().requires_grad_(True)
    logp_N, ent_N = head_logprobs(hidden, head, tok_N, sampling=f, with_entropy=True, chunk_tokens=7)
    assert torch.isfinite(logp_N).all()
    assert (logp_N - engine_logp_N).abs().max() <= 1e-6
    ref_NV = processed_logprobs(logits_NV, f)
    p_NV = ref_NV.exp()
    want_ent = -(p_NV * ref_NV.masked_fill(p_NV == 0, 0.0)).sum(-1)
    torch.testing.assert_close(ent_N, want_ent, rtol=0, atol=1e-5)
    # gradients: against autograd over the masked log-softmax (the support held fixed)
    g = torch.Generator().manual_seed(2)
    w_logp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    (logp_N * w_logp + ent_N * w_ent).sum().backward()
    x = logits_NV.clone().requires_grad_(True)
    keep = ref_NV > INF
    z = (x / f.scale).masked_fill(~keep, INF)
    lsm = z.log_softmax(-1)
    ent_ref = -(lsm.exp() * lsm.masked_fill(~keep, 0.0)).sum(-1)
    (lsm.gather(-1, tok_N[:, None]).squeeze(-1) * w_logp + ent_ref * w_ent).sum().backward()
    torch.testing.assert_close(hidden.grad, x.grad, rtol=1e-4, atol=1e-5)
    assert (hidden.grad[~keep] == 0).all()


def _wrong_top_k(off):
    def fn(logits, f):
        z = logits / f.scale
        k = f.top_k + off
        kth = torch.topk(z, k, dim=-1).values[:, -1:]
        return z.masked_fill(z < kth, INF).log_softmax(-1)
    return fn


def _top_p_crossing_dropped(logits, f):
    """The boundary on the wrong side: the token whose mass crosses top_p is dropped."""
    z = logits / f.scale
    s, idx = torch.sort(z, -1, descending=True)
    drop = s.softmax(-1).cumsum(-1) > f.top_p
    drop[:, 0] = False
    return torch.full_like(z, INF).scatter(-1, idx, s.masked_fill(drop, INF)).log_softmax(-1)


def _not_renormalised(logits, f):
    lp = (logits / f.scale).log_softmax(-1)
    return lp.masked_fill(processed_logprobs(logits, f) == INF, INF)


@pytest.mark.parametrize("wrong,f", [(_wrong_top_k(+1), SamplingFilter(top_k=5)), (_wrong_top_k(-1), SamplingFilter(top_k=5)),
                                     (_top_p_crossing_dropped, SamplingFilter(top_p=0.9)),
                                     (_not_renormalised, SamplingFilter(temperature=0.8, top_k=20, top_p=0.9))])
def test_a_slightly_wrong_engine_filter_is_a_measured_mismatch(wrong, f):
    """The mismatch an engine with a slightly wrong filter would log (the mean |trainer - engine|
    logprob of its sampled tokens, as ``mismatch/abs_logp_diff_mean``) is far above the 1e-5 the
    shared definition meets; a drawn token outside the trainer's support would be -inf without the
    label rule, here a finite but wrong number."""
    logits_NV = _logits(256, 300, seed=4)
    logits_NV[:, 6:12] += torch.arange(6) * 1e-2  # no ties at the top-k boundary: k +- 1 changes the support
    head = torch.nn.Linear(300, 300, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(300))

    @torch.no_grad()
    def mismatch(engine_logp_NV, seed):
        u = torch.from_numpy(keyed_uniforms(seed, torch.arange(len(logits_NV)).numpy(), 0))
        tok_N = inverse_cdf(engine_logp_NV.exp(), u)
        trainer_N, _ = head_logprobs(logits_NV, head, tok_N, sampling=f)
        return float((trainer_N - engine_logp_NV.gather(-1, tok_N[:, None]).squeeze(-1)).abs().mean())

    assert mismatch(processed_logprobs(logits_NV, f), 5) <= 1e-6
    assert mismatch(wrong(logits_NV, f), 5) > 1e-3
