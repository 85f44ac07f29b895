"""Chunked, temperature-aware logprobs equal the full-logits reference (values and gradients)."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.reference import reference_logprobs
from tidal.sampling_filter import SamplingFilter
from tidal.engine.sampler import process_logits, sample
from tidal.models.logprobs import attach_logprob_method, token_logprobs


def _model(tie):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    m = Qwen2ForCausalLM(cfg)
    attach_logprob_method(m)
    return m


def test_chunked_logprobs_match_reference_with_grad():
    m = _model(tie=True)
    ids = torch.randint(0, 50, (3, 7))
    am = torch.ones_like(ids)
    am[1, 5:] = 0
    logp, ent = token_logprobs(m, ids, am, sampling=SamplingFilter(temperature=0.7), with_entropy=True, chunk_tokens=4)
    logits = m(input_ids=ids, attention_mask=am).logits
    ref = reference_logprobs(logits, ids, temperature=0.7)
    mask = am.bool()
    assert torch.allclose(logp[mask], ref[mask], atol=1e-5)
    lp_all = (logits.float() / 0.7).log_softmax(-1)
    ref_ent = -(lp_all.exp() * lp_all).sum(-1)
    assert torch.allclose(ent[:, 1:][mask[:, 1:]], ref_ent[:, :-1][mask[:, 1:]], atol=1e-5)
    # gradients of the chunked (checkpointed) path equal those of the plain path
    (logp * mask).sum().backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    (reference_logprobs(m(input_ids=ids, attention_mask=am).logits, ids, 0.7) * mask).sum().backward()
    for a, p in zip(g1, m.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-5)


def test_process_logits_top_k_top_p_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = process_logits(logits, 1.0, top_k=2, top_p=1.0)
    assert torch.allclose(lp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # top_p 0.7: keeps 0.5 (mass before=0) and 0.3 (mass before=0.5 < 0.7), drops 0.15 (0.8 >= 0.7)
    lp = process_logits(logits, 1.0, top_k=0, top_p=0.7)
    assert torch.allclose(lp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]), atol=1e-6)
    # temperature 2: p ∝ sqrt(p)
    lp = process_logits(logits, 2.0, top_k=0, top_p=1.0)
    q = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(lp.exp(), (q / q.sum())[None], atol=1e-6)


def test_sample_greedy_and_logprob_of_sampled():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    tok, lp = sample(logits, 0.0)
    assert tok.tolist() == [1, 0]
    assert torch.allclose(lp, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1))
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    tok, lp = sample(logits.repeat(2000, 1), 1.0, top_k=1, u_B=u)
    assert (tok.view(-1, 2) == torch.tensor([1, 0])).all() and torch.allclose(lp, torch.zeros_like(lp))


def test_entropy_without_grad_same_values_and_logp_gradients():
    m = _model(tie=False)
    ids = torch.randint(0, 50, (2, 9))
    am = torch.ones_like(ids)
    grads, values = [], []
    for entropy_grad in (True, False):
        m.zero_grad()
        logp, ent = token_logprobs(m, ids, am, sampling=SamplingFilter(temperature=0.9), with_entropy=True, chunk_tokens=5, entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad and logp.requires_grad
        logp.sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        values.append((logp.detach(), ent.detach()))
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
