"""The flash-linear-attention wrappers (:func:`tidal.models.gated_delta_rule.fla_recurrent_step`,
:func:`~tidal.models.gated_delta_rule.fla_chunk_varlen`) on CPU, against a stand-in ``fla`` module
with fla 0.6's signatures (``g, gk, gv, beta`` after ``q, k, v`` in the fused recurrent kernel) that
computes with Tidal's torch forms. The Qwen3.5 GPU crash of issue 50 was a positional ``beta``
landing in fla 0.6's ``gk``: these tests fail on such a call, on any version's argument order,
because the stand-ins refuse anything after ``v`` that is not passed by name."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tidal.models import gated_delta_rule as gdr


def _recurrent(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's fused recurrent kernel for one token per sequence (``[B, 1, H, K]``), by Tidal's torch form."""
    assert gk is None and gv is None and beta is not None and use_qk_l2norm_in_kernel and scale is None
    assert q.shape[1] == 1 and g.shape == beta.shape == v.shape[:3]
    state = initial_state.clone()
    o = gdr.recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    return o[:, None], state if output_final_state else None


def _chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
           cu_seqlens=None):
    """fla's chunked kernel over packed sequences (``[1, N, H, K]``, ``cu_seqlens``), by Tidal's torch form."""
    assert q.shape[0] == 1 and use_qk_l2norm_in_kernel and scale is None
    outs, finals = [], []
    for i in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        o, s = gdr.chunk_gated_delta_rule(q[0, a:b], k[0, a:b], v[0, a:b], g[0, a:b], beta[0, a:b], initial_state[i])
        outs.append(o)
        finals.append(s)
    return torch.cat(outs)[None], torch.stack(finals) if output_final_state else None


def _by_name_only(fn):
    """fn, refusing any argument after ``q, k, v`` that is not passed by name."""
    def call(q, k, v, *positional, **named):
        if positional:
            raise TypeError(f"{fn.__name__}: {len(positional)} argument(s) after q, k, v passed by position; "
                            "fla's order changes between versions: pass them by name")
        return fn(q, k, v, **named)
    return call


@pytest.fixture
def fake_fla(monkeypatch):
    ops = types.ModuleType("fla.ops.gated_delta_rule")
    ops.fused_recurrent_gated_delta_rule = _by_name_only(_recurrent)
    ops.chunk_gated_delta_rule = _by_name_only(_chunk)
    for name, mod in {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
                      "fla.ops.gated_delta_rule": ops}.items():
        monkeypatch.setitem(sys.modules, name, mod)


def _inputs(T, hk=2, hv=4, dk=8, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(T, hv, dv, generator=g)
    decay = -torch.rand(T, hv, generator=g)
    beta = torch.rand(T, hv, generator=g)
    return q, k, v, decay, beta


def test_recurrent_step_passes_beta_as_beta(fake_fla):
    q, k, v, decay, beta = _inputs(3)
    state = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    want_state = state.clone()
    want = gdr.recurrent_gated_delta_rule(q, k, v, decay, beta, want_state)
    got = gdr.fla_recurrent_step(q, k, v, decay, beta, state)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(state, want_state)  # the state is updated in place, as the torch form does


def test_chunk_varlen_passes_gates_by_name_and_keeps_sequences_apart(fake_fla):
    q, k, v, decay, beta = _inputs(7)
    cu = torch.tensor([0, 3, 7])
    states = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    o, final = gdr.fla_chunk_varlen(q, k, v, decay, beta, cu, states)
    for i, (a, b) in enumerate([(0, 3), (3, 7)]):
        want_o, want_s = gdr.chunk_gated_delta_rule(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], states[i])
        torch.testing.assert_close(o[a:b], want_o)
        torch.testing.assert_close(final[i], want_s)


def test_a_positional_gate_is_refused(fake_fla):
    """The stand-in has power: the old call (beta fifth by position) fails."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as step

    q, k, v, decay, beta = _inputs(2)
    with pytest.raises(TypeError, match="by position"):
        step(q[:, None], k[:, None], v[:, None], decay[:, None], beta[:, None], initial_state=torch.zeros(2, 4, 8, 8))
