"""The hand-written LM-head function (_LMHeadLogprobs, lm_head_logprobs) equals plain autograd over
full logits: values, gradients w.r.t. hidden/weight/bias (with and without entropy gradients), and
the positions_BT restriction."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.reference import reference_logprobs
from tests.tolerance import rounding_tol
from tidal.sampling_filter import SamplingFilter
from tidal.models import lm_head, logprobs as lp_mod
from tidal.models.logprobs import attach_logprob_method, lm_head_logprobs, token_logprobs

B, T, H, V = 3, 8, 16, 37  # N = B * (T - 1) = 21 rows: chunks of 4 and 5 do not divide it


def _head(dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g, dtype=torch.float64))
    hidden_BTH = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    ids_BT = torch.randint(0, V, (B, T), generator=g)
    return head, hidden_BTH, ids_BT


def _reference(hidden_BTH, head, ids_BT, temperature, entropy_grad=True):
    """Plain autograd over the full logits (in the model's dtype, softmax math in fp32 or wider)."""
    logits_BTV = F.linear(hidden_BTH, head.weight, head.bias)
    math = torch.promote_types(logits_BTV.dtype, torch.float32)
    logp_BTV = (logits_BTV.to(math) / temperature).log_softmax(-1)
    logp_BT = logp_BTV[:, :-1].gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)[:, :-1]
    if not entropy_grad:
        entropy_BT = entropy_BT.detach()
    pad_B1 = logp_BT.new_zeros(B, 1)
    return torch.cat([pad_B1, logp_BT], 1), torch.cat([pad_B1, entropy_BT], 1)


def _grads(out, params):
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, torch.autograd.grad(out, params, allow_unused=True))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [4, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_matches_full_logits_fp32(temperature, chunk, bias):
    head, hidden_BTH, ids_BT = _head(torch.float32, bias)
    logp_BT, ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, sampling=SamplingFilter(temperature=temperature), with_entropy=True, chunk_tokens=chunk)
    logits_BTV = head(hidden_BTH)
    ref_logp_BT, ref_ent_BT = _reference(hidden_BTH, head, ids_BT, temperature)
    torch.testing.assert_close(logp_BT, reference_logprobs(logits_BTV, ids_BT, temperature), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_BT, ref_ent_BT, rtol=0, atol=5e-5)  # logZ - sum p z: cancellation of ~10s
    assert logp_BT.dtype == ent_BT.dtype == torch.float32
    assert (logp_BT[:, 0] == 0).all() and (ent_BT[:, 0] == 0).all()
    logp_only_BT, none = lm_head_logprobs(hidden_BTH, head, ids_BT, sampling=SamplingFilter(temperature=temperature), chunk_tokens=chunk)
    assert none is None and torch.equal(logp_only_BT, logp_BT)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_bf16_rounds_logits_like_the_model(temperature):
    """bf16 hidden/weight: logits are rounded to bf16 (as ``F.linear(...).float()``), the rest is fp32."""
    head, hidden_BTH, ids_BT = _head(torch.bfloat16, bias=True)
    logp_BT, ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, sampling=SamplingFilter(temperature=temperature), with_entropy=True, chunk_tokens=5)
    ref_logp_BT, ref_ent_BT = _reference(hidden_BTH, head, ids_BT, temperature)
    assert logp_BT.dtype == torch.float32
    torch.testing.assert_close(logp_BT, ref_logp_BT, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_BT, ref_ent_BT, rtol=0, atol=5e-5)
    # the fp32 computation of the same weights differs by far more: the bf16 rounding is kept
    logp32_BT, _ = _reference(hidden_BTH.float(), head.float(), ids_BT, temperature)
    assert (logp32_BT - logp_BT).abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("terms", ["both", "logp", "entropy"])
def test_gradients_match_autograd_float64(temperature, bias, entropy_grad, terms):
    head, hidden_BTH, ids_BT = _head(torch.float64, bias)
    params = [hidden_BTH, head.weight] + ([head.bias] if bias else [])
    g = torch.Generator().manual_seed(1)
    a_BT, c_BT = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)

    def loss(logp_BT, ent_BT):
        parts = {"logp": (a_BT * logp_BT).sum(), "entropy": (c_BT * ent_BT).sum()}
        return sum(v for k, v in parts.items() if terms in (k, "both"))

    logp_BT, ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, sampling=SamplingFilter(temperature=temperature), with_entropy=True, chunk_tokens=5,
                                       entropy_grad=entropy_grad)
    assert logp_BT.dtype == torch.float64 and ent_BT.requires_grad == entropy_grad
    ref = _reference(hidden_BTH, head, ids_BT, temperature, entropy_grad)
    torch.testing.assert_close((logp_BT, ent_BT), ref, rtol=1e-12, atol=1e-12)
    if terms == "entropy" and not entropy_grad:
        assert not loss(logp_BT, ent_BT).requires_grad
        return
    got, want = _grads(loss(logp_BT, ent_BT), params), _grads(loss(*ref), params)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    assert any(y.abs().max() > 1e-3 for y in want)


def test_entropy_gradient_term_is_not_vacuous():
    """With entropy_grad the entropy term changes the gradients (so the checks above can fail)."""
    head, hidden_BTH, ids_BT = _head(torch.float64, bias=True)
    out = [lm_head_logprobs(hidden_BTH, head, ids_BT, with_entropy=True, chunk_tokens=4, entropy_grad=eg) for eg in (True, False)]
    g_true = torch.autograd.grad(out[0][0].sum() + out[0][1].sum(), [hidden_BTH])[0]
    g_false = torch.autograd.grad(out[1][0].sum() + out[1][1].detach().sum(), [hidden_BTH])[0]
    assert (g_true - g_false).abs().max() > 1e-3


def test_gradients_bf16_dtypes_and_values():
    """bf16 model: gradients come back in bf16 and agree with bf16 autograd within bf16 rounding."""
    head, hidden_BTH, ids_BT = _head(torch.bfloat16, bias=True)
    params = [hidden_BTH, head.weight, head.bias]
    logp_BT, ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, sampling=SamplingFilter(temperature=0.7), with_entropy=True, chunk_tokens=4)
    got = _grads(logp_BT.sum() + 0.3 * ent_BT.sum(), params)
    ref_logp_BT, ref_ent_BT = _reference(hidden_BTH, head, ids_BT, 0.7)
    want = _grads(ref_logp_BT.sum() + 0.3 * ref_ent_BT.sum(), params)
    for x, y in zip(got, want):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2 * y.float().abs().max().item())


def test_only_requested_input_gradients():
    head, hidden_BTH, ids_BT = _head(torch.float64, bias=True)
    head.weight.requires_grad_(False)
    logp_BT, _ = lm_head_logprobs(hidden_BTH, head, ids_BT, chunk_tokens=4)
    logp_BT.sum().backward()
    assert head.weight.grad is None and head.bias.grad is not None and hidden_BTH.grad is not None


def _positions(seed=2):
    g = torch.Generator().manual_seed(seed)
    pos_BT = torch.rand(B, T, generator=g) < 0.5
    pos_BT[0, 0] = True  # column 0 is ignored
    pos_BT[1] = False  # a row with no position
    return pos_BT


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_positions_equal_full_computation_values_and_gradients(entropy_grad):
    head, hidden_BTH, ids_BT = _head(torch.float64, bias=True)
    params = [hidden_BTH, head.weight, head.bias]
    pos_BT = _positions()
    sel_BT = pos_BT.clone()
    sel_BT[:, 0] = False
    kw = dict(sampling=SamplingFilter(temperature=0.7), with_entropy=True, chunk_tokens=3, entropy_grad=entropy_grad)
    logp_BT, ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, positions_BT=pos_BT.long(), **kw)
    full_logp_BT, full_ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, **kw)
    assert torch.equal(logp_BT[sel_BT], full_logp_BT[sel_BT]) and torch.equal(ent_BT[sel_BT], full_ent_BT[sel_BT])
    assert (logp_BT[~sel_BT] == 0).all() and (ent_BT[~sel_BT] == 0).all()
    assert (full_logp_BT[~sel_BT] != 0).any()
    assert ent_BT.requires_grad == entropy_grad
    got = _grads(logp_BT.sum() + 0.5 * ent_BT.sum(), params)
    want = _grads((full_logp_BT * sel_BT).sum() + 0.5 * (full_ent_BT * sel_BT).sum(), params)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    assert hidden_BTH.grad is None and (got[0][~torch.roll(sel_BT, -1, 1)] == 0).all()  # unselected rows get no gradient


def test_positions_none_selected_and_shape_error():
    head, hidden_BTH, ids_BT = _head(torch.float32, bias=True)
    logp_BT, ent_BT = lm_head_logprobs(hidden_BTH, head, ids_BT, with_entropy=True, positions_BT=torch.zeros(B, T, dtype=torch.bool))
    assert (logp_BT == 0).all() and (ent_BT == 0).all()
    (logp_BT.sum() + ent_BT.sum()).backward()
    assert (head.weight.grad == 0).all() and (hidden_BTH.grad == 0).all()
    with pytest.raises(ValueError, match="positions_BT"):
        lm_head_logprobs(hidden_BTH, head, ids_BT, positions_BT=torch.ones(B, T - 1, dtype=torch.bool))


def test_token_logprobs_threads_positions_through_the_attached_method():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    m = Qwen2ForCausalLM(cfg)
    attach_logprob_method(m)
    ids_BT = torch.randint(0, 50, (B, T))
    am_BT = torch.ones_like(ids_BT)
    pos_BT = _positions()
    sel_BT = pos_BT.clone()
    sel_BT[:, 0] = False
    logp_BT, ent_BT = token_logprobs(m, ids_BT, am_BT, sampling=SamplingFilter(temperature=0.9), with_entropy=True, chunk_tokens=4, positions_BT=pos_BT)
    full_logp_BT, full_ent_BT = token_logprobs(m, ids_BT, am_BT, sampling=SamplingFilter(temperature=0.9), with_entropy=True, chunk_tokens=4)
    atol = rounding_tol(torch.float32, full_logp_BT.abs().max() + full_ent_BT.abs().max())  # entropy = logZ - sum p z
    torch.testing.assert_close(logp_BT, full_logp_BT * sel_BT, rtol=0, atol=atol)
    torch.testing.assert_close(ent_BT, full_ent_BT * sel_BT, rtol=0, atol=atol)
    assert (logp_BT[~sel_BT] == 0).all()


def test_cpu_runs_eagerly_and_head_compile_is_set_per_model(monkeypatch):
    monkeypatch.setattr(lm_head, "_COMPILED", {})
    head, hidden_BTH, ids_BT = _head(torch.float32, bias=False)
    lm_head_logprobs(hidden_BTH, head, ids_BT, with_entropy=True)[0].sum().backward()
    assert lm_head._COMPILED == {}  # CPU tensors never compile
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    on, off = Qwen2ForCausalLM(cfg), Qwen2ForCausalLM(cfg)
    attach_logprob_method(on)
    attach_logprob_method(off)
    lp_mod.set_head_compile(off, False)  # what a strategy that does not compile does to the models it prepares
    seen = []
    run = lm_head._run
    monkeypatch.setattr(lm_head, "_run", lambda fn, compile_head, *a: seen.append(compile_head) or run(fn, compile_head, *a))
    ids_BT = torch.randint(0, 50, (2, 5))
    for m in (on, off):
        token_logprobs(m, ids_BT, torch.ones_like(ids_BT), chunk_tokens=4)[0].sum().backward()
    assert seen == [True] * 4 + [False] * 4  # 2 forward + 2 backward chunks each: the other model keeps its own
    setattr(off, lp_mod.LOGPROB_METHOD, lambda *a: None)  # wrapped (e.g. by FSDP) before it was set
    with pytest.raises(TypeError, match="already wrapped"):
        lp_mod.set_head_compile(off, True)
