"""Packed (padding-free) forwards of sliding-window models (Gemma 3, OLMo 3) equal their padded
per-sequence forwards: each layer's window applies inside its own sequence and never reaches across
a ``cu_seqlens`` boundary. A packed forward that ignores the window fails by far more than the
tolerance. CPU, fp32 (the reference varlen kernel); tolerance as tests/unit/test_packed_forward.py."""

import copy

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Olmo3Config, Olmo3ForCausalLM

from tidal.models import varlen
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.varlen import enable_packed_attention

LOGP = dict(atol=1e-5, rtol=1e-5)
COMMON = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=64, vocab_size=97, sliding_window=4, initializer_range=0.1,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
MODELS = {"gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(query_pre_attn_scalar=8)),
          "olmo3": (Olmo3Config, Olmo3ForCausalLM, {})}


@pytest.fixture(scope="module", params=list(MODELS))
def models(request):
    cfg_cls, model_cls, extra = MODELS[request.param]
    torch.manual_seed(0)
    plain = model_cls(cfg_cls(**COMMON, **extra)).eval()
    attach_logprob_method(plain)
    packed = enable_packed_attention(copy.deepcopy(plain))
    return plain, packed


def _batch(lengths=(9, 14, 4, 11), prompts=(3, 5, 2, 6)):
    g = torch.Generator().manual_seed(0)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(1, 97, (B, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    act = (am.bool() & (torch.arange(T)[None] >= torch.tensor(prompts)[:, None])).float()
    return ids * am, am, act


@torch.no_grad()
def test_packed_logprobs_equal_each_sequence_alone(models):
    plain, packed = models
    ids, am, act = _batch()
    want = torch.cat([token_logprobs(plain, ids[b : b + 1], am[b : b + 1], positions_BT=act[b : b + 1])[0]
                      for b in range(len(ids))])  # each sequence on its own
    got, _ = token_logprobs(packed, ids, am, packed=PackedBatch.build(ids, am, targets_BT=act))
    torch.testing.assert_close(got, want, **LOGP)


@torch.no_grad()
def test_packed_forward_ignoring_the_window_fails(models, monkeypatch):
    plain, packed = models
    ids, am, act = _batch()
    want, _ = token_logprobs(plain, ids, am, positions_BT=act)
    real = varlen.varlen_attention
    monkeypatch.setattr(varlen, "varlen_attention", lambda *a, window=None, **kw: real(*a, **kw))
    got, _ = token_logprobs(packed, ids, am, packed=PackedBatch.build(ids, am, targets_BT=act))
    assert (got - want).abs().max().item() > 100 * LOGP["atol"]
