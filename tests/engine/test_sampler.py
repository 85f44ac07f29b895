"""The sampler's draw: one uniform per row inverted through a two-level CDF (chunk sums, then the
tokens of the chosen chunk). Its frequencies over many keyed draws match the processed distribution
as ``transformers``' own warpers define it, by a chi-square test that the biased variants below
fail (a search off by one, a draw that ignores the last chunk, a top-p that keeps too much); the
CDF positions of its draws are uniform by a smooth test that a 2% tilt of the uniform fails; and
the keyed uniforms depend on (seed, request, position) only."""

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from tidal.engine import sampler
from tidal.engine.sampler import inverse_cdf, keyed_uniforms, monotone_cdf, process_logits, request_key, sample, search


def _chi2_exceeds(counts_K: torch.Tensor, p_K: torch.Tensor, z: float = 3.09) -> bool:
    """Whether the chi-square statistic of ``counts_K`` against probabilities ``p_K`` exceeds its
    0.999 quantile (Wilson-Hilferty); bins of tiny expectation are pooled into one."""
    n = counts_K.sum().item()
    expected_K = p_K.double() * n
    big = expected_K >= 5
    obs = torch.cat([counts_K[big].double(), counts_K[~big].double().sum()[None]])
    exp = torch.cat([expected_K[big], expected_K[~big].sum()[None]])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return True  # a draw where the distribution has no mass
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    k = int(keep.sum()) - 1
    return stat > k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def _draw(fn, p_V: torch.Tensor, n: int, seed: int = 0, rows: int = 4000) -> torch.Tensor:
    """Counts per token of ``n`` draws ``fn(p_BV, u_B)`` from the weights ``p_V`` (seeded uniforms)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(p_V), dtype=torch.long)
    for _ in range(n // rows):
        tok_B = fn(p_V.expand(rows, -1), torch.rand(rows, generator=g))
        counts += torch.bincount(tok_B, minlength=len(p_V))
    return counts


def _weights(V: int = 37, seed: int = 1) -> torch.Tensor:
    """Unnormalised weights over ``V`` tokens, some zero, with mass in every chunk of 8 (the last,
    tokens 32-36, about 8% of it)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(V, generator=g) + 0.05
    w[torch.tensor([3, 9, 10, 33])] = 0.0
    return w


def _off_by_one_search(cdf_BK, positive_BK, target_B):
    # the classic slip: the last index whose prefix sum is <= target (one before the right one)
    return (search(cdf_BK, positive_BK, target_B) - 1).clamp_min(0)


def test_two_level_inverse_cdf_draws_the_distribution_and_biased_variants_fail(monkeypatch):
    w = _weights()
    p = w / w.sum()
    draw = lambda p_BV, u_B: inverse_cdf(p_BV, u_B, chunk=8)  # noqa: E731
    counts = _draw(draw, w, 200_000)
    assert counts[w == 0].sum() == 0
    assert not _chi2_exceeds(counts, p)

    # ignoring the last chunk (a loop that stops one chunk early): renormalised over the rest
    no_last = lambda p_BV, u_B: inverse_cdf(p_BV[:, :32], u_B, chunk=8)  # noqa: E731
    assert _chi2_exceeds(_draw(no_last, w, 200_000), p)
    # the search off by one (at both levels, then only inside the chunk)
    with monkeypatch.context() as m:
        m.setattr(sampler, "search", _off_by_one_search)
        assert _chi2_exceeds(_draw(draw, w, 200_000), p)


def test_within_chunk_off_by_one_fails_too():
    """A subtler slip: the token inside the chunk found against the chunk's own mass before it
    rather than the prefix of all chunks before it (right for the first two chunks only)."""
    w = _weights()
    p = w / w.sum()

    def wrong_offset(p_BV, u_B, chunk=8):
        B, V = p_BV.shape
        n = -(-V // chunk)
        p_BNC = torch.nn.functional.pad(p_BV, (0, n * chunk - V)).view(B, n, chunk)  # a reference layout
        mass_BN = p_BNC.sum(-1)
        cdf_BN = monotone_cdf(mass_BN)
        target_B = u_B * cdf_BN[:, -1]
        c_B = search(cdf_BN, mass_BN > 0, target_B)
        before_B = torch.where(c_B > 0, mass_BN.gather(-1, (c_B - 1).clamp_min(0)[:, None]).squeeze(-1), 0.0)
        p_BC = p_BNC[torch.arange(B), c_B]
        return c_B * chunk + search(monotone_cdf(p_BC), p_BC > 0, target_B - before_B)

    assert _chi2_exceeds(_draw(wrong_offset, w, 200_000), p)


def test_search_guards_non_monotone_sums_and_the_top_end():
    # a parallel scan rounded the third sum below the second: made monotone, the target 0.295 is in
    # element 1's interval, not element 2's (which has no mass)
    w = torch.tensor([[0.1, 0.2, 0.0, 0.3]])
    raw = torch.tensor([[0.1, 0.3, 0.29, 0.6]])
    cdf = torch.cummax(raw.masked_fill(w <= 0, 0.0), -1).values
    assert search(cdf, w > 0, torch.tensor([0.295])).item() == 1
    assert monotone_cdf(w).tolist() == [[pytest.approx(0.1), pytest.approx(0.3), pytest.approx(0.3), pytest.approx(0.6)]]
    # a target at (or rounded past) the total: the last element of positive weight, never a zero one
    w = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert search(monotone_cdf(w), w > 0, torch.tensor([1.0])).item() == 1
    assert inverse_cdf(torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([0.0]), chunk=2).item() == 1
    assert inverse_cdf(torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([1.0 - 2**-24]), chunk=2).item() == 1


def _hf_reference_logp(logits_BV: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The processed distribution as ``transformers`` defines it: its own warpers, in the order its
    ``generate`` applies them (temperature, top-k, top-p), then a softmax."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits_BV.float()).log_softmax(-1)


def _uniforms(seed: int, rows: int, first_key: int = 0, pos: int = 7) -> torch.Tensor:
    """One keyed uniform per row: requests ``first_key..``, the token at index ``pos``."""
    return torch.from_numpy(keyed_uniforms(np.full(rows, seed), np.arange(first_key, first_key + rows), np.full(rows, pos)))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.0, 40, 1.0), (1.0, 0, 0.8), (0.7, 50, 0.9)])
def test_sample_draws_the_transformers_processed_distribution_with_its_logprobs(temperature, top_k, top_p):
    """End to end over a vocabulary of three chunks of 1024 (the last one partial), against the
    distribution ``transformers``' warpers define (not Tidal's :func:`process_logits`)."""
    g = torch.Generator().manual_seed(3)
    V = 2100
    logits_V = torch.randn(V, generator=g) * 0.5
    hot = torch.tensor([5, 700, 1100, 1500, 2050, 2099])  # mass in every chunk, the last one included
    logits_V[hot] = torch.tensor([4.0, 3.5, 3.0, 4.5, 3.8, 3.2])
    ref_V = _hf_reference_logp(logits_V[None], temperature, top_k, top_p)[0]
    counts = torch.zeros(V, dtype=torch.long)
    rows = 2000
    for k in range(20):
        tok_B, lp_B = sample(logits_V.expand(rows, -1), temperature, top_k, top_p, _uniforms(0, rows, k * rows))
        torch.testing.assert_close(lp_B, ref_V[tok_B], rtol=0, atol=1e-5)  # the logprob of that distribution
        counts += torch.bincount(tok_B, minlength=V)
    assert counts[ref_V == float("-inf")].sum() == 0
    assert not _chi2_exceeds(counts, ref_V.exp())
    # a top-p that keeps one token too many (the token that crosses top_p, and the next) fails the same test
    if top_p < 1.0:
        def one_too_many(logits_BV, t, k, p):
            keep_BV = _hf_reference_logp(logits_BV, t, k, p) > float("-inf")
            extra_BV = _hf_reference_logp(logits_BV, t, k, min(1.0, p + 0.02)) > float("-inf")
            return process_logits(logits_BV, t, k, 1.0).masked_fill(~(keep_BV | extra_BV), float("-inf")).log_softmax(-1)

        wide = one_too_many(logits_V[None], temperature, top_k, top_p)[0].exp()
        counts = torch.bincount(inverse_cdf(wide.expand(20_000, -1), _uniforms(1, 20_000)), minlength=V)
        assert _chi2_exceeds(counts, ref_V.exp())


def test_the_same_uniform_draws_the_same_token_alone_or_in_any_batch():
    """Row b's draw depends on its logits and its uniform only: a row sampled alone, or in a batch
    with other rows in any order, takes the same token and logprob."""
    g = torch.Generator().manual_seed(5)
    logits_BV = torch.randn(9, 3000, generator=g) * 2
    u_B = _uniforms(4, 9)
    for top_k, top_p in ((0, 1.0), (30, 1.0), (0, 0.9)):
        tok_B, lp_B = sample(logits_BV, 0.8, top_k, top_p, u_B)
        perm = torch.randperm(9, generator=g)
        tok_P, lp_P = sample(logits_BV[perm], 0.8, top_k, top_p, u_B[perm])
        assert torch.equal(tok_P, tok_B[perm]) and torch.equal(lp_P, lp_B[perm])
        for b in range(9):
            tok, lp = sample(logits_BV[b : b + 1], 0.8, top_k, top_p, u_B[b : b + 1])
            assert tok.item() == tok_B[b].item() and lp.item() == lp_B[b].item()
    with pytest.raises(ValueError, match="one uniform per row"):
        sample(logits_BV, 0.8)


def test_keyed_uniforms_depend_on_seed_key_and_position_only():
    seed, key, pos = np.array([3, 3, 3, 4]), np.array([10, 11, 10, 10]), np.array([5, 5, 6, 5])
    u = keyed_uniforms(seed, key, pos)
    assert len(set(u.tolist())) == 4  # each of the three changes the draw
    assert np.array_equal(u[::-1], keyed_uniforms(seed[::-1], key[::-1], pos[::-1]))  # order does not matter
    assert u[1] == keyed_uniforms(3, 11, 5) and u.dtype == np.float32
    assert ((u >= 0) & (u < 1)).all() and (keyed_uniforms(2**64 - 1, 2**64 - 1, 0) < 1)
    assert request_key("a") == request_key("a") != request_key("b") and request_key(-1) == 2**64 - 1


def test_keyed_uniforms_are_uniform_and_independent_over_keys_and_positions():
    """200k uniforms of consecutive keys and positions (the engine's pattern): 64 equal bins pass a
    chi-square test, and so do the pairs of consecutive positions of one key (an 8 x 8 grid)."""
    keys, pos = np.meshgrid(np.arange(2000), np.arange(100), indexing="ij")
    u_KP = keyed_uniforms(np.full(keys.shape, 17), keys, pos)
    counts = torch.from_numpy(np.bincount((u_KP * 64).astype(np.int64).ravel(), minlength=64))
    assert not _chi2_exceeds(counts, torch.full((64,), 1 / 64))
    pairs = (u_KP[:, :-1:2] * 8).astype(np.int64) * 8 + (u_KP[:, 1::2] * 8).astype(np.int64)
    assert not _chi2_exceeds(torch.from_numpy(np.bincount(pairs.ravel(), minlength=64)), torch.full((64,), 1 / 64))
    # a generator keyed without the position (one uniform per request) fails the pair test at once
    flat = np.repeat(u_KP[:, :1], 100, axis=1)
    pairs = (flat[:, :-1:2] * 8).astype(np.int64) * 8 + (flat[:, 1::2] * 8).astype(np.int64)
    assert _chi2_exceeds(torch.from_numpy(np.bincount(pairs.ravel(), minlength=64)), torch.full((64,), 1 / 64))


def _pit_smooth_stat(pit: np.ndarray) -> float:
    """Neyman's smooth test statistic of order 2 for uniformity on [0, 1] (chi-square with 2 degrees
    of freedom under uniformity): the squared sums of the first two Legendre polynomials."""
    x = 2 * pit - 1
    n = len(pit)
    z1 = math.sqrt(3) * x.sum() / math.sqrt(n)
    z2 = math.sqrt(5) * (1.5 * x**2 - 0.5).sum() / math.sqrt(n)
    return z1 * z1 + z2 * z2


def _cdf_positions(draw, n: int = 400_000, V: int = 32, rows: int = 100_000) -> np.ndarray:
    """The randomised CDF position ``F(tok - 1) + w p(tok)`` (``w`` an independent uniform) of ``n``
    draws ``draw(p_BV, u_B)`` from a fixed distribution over ``V`` tokens with keyed uniforms;
    uniform on [0, 1] iff the draws follow the distribution."""
    p_V = torch.randn(V, generator=torch.Generator().manual_seed(9)).softmax(-1)
    before_V = (torch.cumsum(p_V.double(), 0) - p_V.double()).numpy()
    jitter = np.random.default_rng(0)
    out = []
    for k in range(n // rows):
        tok_B = draw(p_V.expand(rows, -1), _uniforms(21, rows, k * rows)).numpy()
        out.append(before_V[tok_B] + p_V.double().numpy()[tok_B] * jitter.random(rows))
    return np.concatenate(out)


def test_cdf_position_of_draws_is_uniform_and_a_two_percent_tilt_fails():
    """The two-level inversion's draws (over 4 chunks) with keyed uniforms put the sampled tokens'
    CDF positions uniformly on [0, 1] (Neyman's smooth test below its 0.999 quantile, 13.8);
    drawing with the uniform tilted smoothly by 2% (``u + 0.02 u (1 - u)``: the density off by at
    most 2%) is rejected."""
    draw = lambda p_BV, u_B: inverse_cdf(p_BV, u_B, chunk=8)  # noqa: E731
    assert _pit_smooth_stat(_cdf_positions(draw)) < 13.8
    tilted = lambda p_BV, u_B: draw(p_BV, u_B + 0.02 * u_B * (1 - u_B))  # noqa: E731
    assert _pit_smooth_stat(_cdf_positions(tilted)) > 13.8


def test_greedy_takes_the_argmax_with_the_untempered_logprob():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    tok, lp = sample(logits, 0.0)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1))


def test_a_row_of_non_finite_logits_samples_no_token_and_reads_nothing_outside_it():
    """A NaN row (the Qwen3.5 GPU crash of issue 50 started as one) gets token -1 and a NaN logprob,
    in the two-level inverse CDF too (its chunk index stays in the row); the other rows are untouched."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    u = torch.tensor([0.3, 0.6, 0.9])
    want_tok, want_logp = sample(logits, 1.0, u_B=u)
    bad = logits.clone()
    bad[1] = float("nan")
    tok, logp = sample(bad, 1.0, u_B=u)
    assert tok[1] == -1 and torch.isnan(logp[1])
    assert tok[[0, 2]].tolist() == want_tok[[0, 2]].tolist() and torch.equal(logp[[0, 2]], want_logp[[0, 2]])
    assert inverse_cdf(torch.zeros(2, 700), torch.tensor([0.1, 0.99])).tolist() == [-1, -1]


def test_an_engine_step_with_non_finite_logits_says_so():
    from tests.engine.helpers import engine_for, tiny_hf
    from tidal.engine.base import SamplingParams
    from tidal.engine.native.model_runner import NonFiniteLogits

    hf = tiny_hf("qwen2")
    with torch.no_grad():
        hf.lm_head.weight[3, 0] = float("nan")  # every row's logit of token 3 is NaN
    engine = engine_for(hf)
    with pytest.raises(NonFiniteLogits, match="not finite"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, seed=0))
