"""Gated DeltaNet kernels (tidal.models.gated_delta_rule) against transformers' torch forms."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from tidal.models.gated_delta_rule import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

from tests.tolerance import rounding_tol

T, HK, HV, DK, DV = 37, 2, 4, 8, 16


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, HK, DK, generator=gen), torch.randn(T, HK, DK, generator=gen)
    v = torch.randn(T, HV, DV, generator=gen)
    g = -2 * torch.rand(T, HV, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    state = 0.3 * torch.randn(HV, DK, DV, generator=gen)
    return q, k, v, g, beta, state


def _hf_recurrent(q, k, v, g, beta, state):
    o, s = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                initial_state=state[None], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


def _close(a, b):
    return (a - b).abs().max().item() <= rounding_tol(torch.float32, b)


@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_equals_hf_token_by_token(inputs, chunk):
    ref_o, ref_s = _hf_recurrent(*inputs)
    o, s = chunk_gated_delta_rule(*inputs, chunk=chunk)
    assert _close(o, ref_o) and _close(s, ref_s)


def test_recurrent_steps_equal_chunked_and_split_prefill(inputs):
    q, k, v, g, beta, state = inputs
    ref_o, ref_s = _hf_recurrent(*inputs)
    s = state[None].clone()
    o = torch.cat([recurrent_gated_delta_rule(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                                              beta[i : i + 1], s) for i in range(T)])
    assert _close(o, ref_o) and _close(s[0], ref_s)
    # a prefill in two pieces, the state handed over between them, equals one piece
    o1, s1 = chunk_gated_delta_rule(q[:20], k[:20], v[:20], g[:20], beta[:20], state, chunk=8)
    o2, s2 = chunk_gated_delta_rule(q[20:], k[20:], v[20:], g[20:], beta[20:], s1, chunk=8)
    assert _close(torch.cat([o1, o2]), ref_o) and _close(s2, ref_s)


@pytest.mark.parametrize("wrong", ["gate", "decay", "state"])
def test_slightly_wrong_step_fails(inputs, wrong):
    """The tolerance catches a gate (beta), decay (g) or state copy off by 1%."""
    q, k, v, g, beta, state = inputs
    ref_o, ref_s = _hf_recurrent(*inputs)
    bad = {"gate": (q, k, v, g, beta * 1.01, state), "decay": (q, k, v, g * 1.01, beta, state),
           "state": (q, k, v, g, beta, state * 1.01)}[wrong]
    o, s = chunk_gated_delta_rule(*bad, chunk=8)
    assert not _close(o, ref_o)


def test_conv_equals_hf_with_state_across_steps():
    gen = torch.Generator().manual_seed(1)
    C, K = 6, 4
    x = torch.randn(1, C, 11, generator=gen)
    w = torch.randn(C, K, generator=gen)
    ref = hf.causal_conv1d_fn(x, w, None, activation="silu")[0].t()  # [T, C], zeros before the first input
    y1, st = causal_conv1d(x[0, :, :5].t(), w)
    y2, st = causal_conv1d(x[0, :, 5:7].t(), w, st)  # shorter than the state: earlier inputs kept
    steps = []
    st_B = st[None].clone()
    for t in range(7, 11):
        steps.append(causal_conv1d_step(x[:, :, t], w, st_B))
    y = torch.cat([y1, y2, torch.cat(steps)])
    assert _close(y, ref)
    assert torch.equal(st_B[0], x[0, :, 8:11])
    # a state off by one input (a wrong copy) changes the output
    bad, _ = causal_conv1d(x[0, :, 5:7].t(), w, torch.roll(st, 1, dims=1))
    assert not _close(bad, ref[5:7])
