"""The sampler's draw: one uniform per row inverted through a two-level CDF (chunk sums, then the
tokens of the chosen chunk). Its frequencies over many seeded draws match the processed
distribution (:func:`process_logits`) by a chi-square test that the biased variants below fail:
a search off by one and a draw that ignores the last chunk."""

import math

import pytest
import torch

from tidal.engine import sampler
from tidal.engine.sampler import inverse_cdf, monotone_cdf, process_logits, sample, search


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


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.0, 40, 1.0), (1.0, 0, 0.8), (0.7, 50, 0.9)])
def test_sample_draws_the_processed_distribution_with_its_logprobs(temperature, top_k, top_p):
    """End to end over a vocabulary of three chunks of 1024 (the last one partial)."""
    g = torch.Generator().manual_seed(3)
    V = 2100
    logits_V = torch.randn(V, generator=g) * 0.5
    hot = torch.tensor([5, 700, 1100, 1500, 2050, 2099])  # mass in every chunk, the last one included
    logits_V[hot] = torch.tensor([4.0, 3.5, 3.0, 4.5, 3.8, 3.2])
    logp_V = process_logits(logits_V[None], temperature, top_k, top_p)[0]
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.long)
    rows = 2000
    for _ in range(20):
        tok_B, lp_B = sample(logits_V.expand(rows, -1), temperature, top_k, top_p, gen)
        assert torch.equal(lp_B, logp_V[tok_B])  # the logprob of the processed distribution
        counts += torch.bincount(tok_B, minlength=V)
    assert counts[logp_V == float("-inf")].sum() == 0
    assert not _chi2_exceeds(counts, logp_V.exp())
    # one uniform per row from the generator: the same seed, the same draws
    again = sample(logits_V.expand(rows, -1), temperature, top_k, top_p, torch.Generator().manual_seed(0))
    first = sample(logits_V.expand(rows, -1), temperature, top_k, top_p, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], first[0])


def test_greedy_takes_the_argmax_with_the_untempered_logprob():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    tok, lp = sample(logits, 0.0)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1))
