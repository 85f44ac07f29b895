"""Packed training through Qwen3.5's Gated DeltaNet layers (tidal.models.linear_attention): packed
logprobs and gradients equal each sequence's own, and nothing leaks across a sequence start (CPU, fp32)."""

import copy

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from tidal.models import linear_attention
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.varlen import enable_packed_attention

CFG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           intermediate_size=48, vocab_size=97, linear_num_key_heads=2, linear_num_value_heads=4,
           linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
LOGP = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    plain = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CFG))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.normal_(0, 0.3)
    attach_logprob_method(plain)
    packed = copy.deepcopy(plain)
    enable_packed_attention(packed)
    return plain, packed


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, 97, (len(lengths), T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * am, am, (am.bool() & (torch.arange(T)[None] >= 1)).float()


def _packed(model, ids, am, act):
    return token_logprobs(model, ids, am, packed=PackedBatch.build(ids, am, targets_BT=act))[0]


def test_packed_logprobs_and_grads_equal_each_sequence_alone(models):
    plain, packed = models
    ids, am, act = _rows([9, 70, 4, 13])  # 70 > one 64-token chunk of the delta rule
    got = _packed(packed, ids, am, act)
    packed.zero_grad()
    (got * act).sum().backward()
    grads = {n: p.grad.clone() for n, p in packed.named_parameters() if p.grad is not None}
    plain.zero_grad()
    for b, n in enumerate(am.sum(1).tolist()):
        want = token_logprobs(plain, ids[b : b + 1, :n], am[b : b + 1, :n])[0]
        torch.testing.assert_close(got[b, 1:n], want[0, 1:n], **LOGP)
        (want * act[b : b + 1, :n]).sum().backward()
    assert {n for n in grads if "linear_attn" in n} >= {"model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.conv1d.weight"}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("leak", [None, "state", "conv"])
def test_second_sequence_ignores_the_first(models, monkeypatch, leak):
    """Changing the first packed sequence leaves the second's logprobs as they were; an
    implementation whose delta-rule state or conv window crosses the boundary fails this."""
    _, packed = models
    if leak == "state":  # one sequence over the whole row
        real = linear_attention.varlen_gated_delta_rule
        monkeypatch.setattr(linear_attention, "varlen_gated_delta_rule",
                            lambda *a: real(*a[:-1], torch.tensor([0, a[0].shape[0]], dtype=torch.int32)))
    elif leak == "conv":
        real_conv = linear_attention.varlen_causal_conv1d
        monkeypatch.setattr(linear_attention, "varlen_causal_conv1d",
                            lambda x, w, cu: real_conv(x, w, torch.tensor([0, x.shape[0]], dtype=torch.int32)))
    ids, am, act = _rows([12, 10], seed=1)
    with torch.no_grad():
        before = _packed(packed, ids, am, act)
        ids2 = ids.clone()
        ids2[0, :12] = (ids[0, :12] + 7) % 96 + 1
        after = _packed(packed, ids2, am, act)
    same = torch.allclose(after[1], before[1], atol=1e-6)
    assert same == (leak is None)


def test_padded_rows_equal_hf_forward(models):
    """Not packed (rows padded on either side, as the SFT warm start and HF run them): the same
    kernels on every row at once equal the HF layer's forward on the rows' real tokens."""
    plain, _ = models
    ours = copy.deepcopy(plain)
    assert linear_attention.enable_packed_linear_attention(ours) == 1
    ids, am, _ = _rows([9, 70, 4], seed=2)
    left = torch.stack([torch.roll(r, int((m == 0).sum())) for r, m in zip(ids, am)])
    left_am = torch.stack([torch.roll(m, int((m == 0).sum())) for m in am])
    with torch.no_grad():
        for x, m in ((ids, am), (left, left_am)):
            got = ours(input_ids=x, attention_mask=m).logits
            want = plain(input_ids=x, attention_mask=m).logits
            torch.testing.assert_close(got[m.bool()], want[m.bool()], **LOGP)


def test_conditional_generation_text_rows_pack_exactly():
    """A Qwen3_5ForConditionalGeneration trained on text rows (text-only RL): packed equals padded."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    vl = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=CFG, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32),
        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)).eval()
    attach_logprob_method(vl)
    packed = copy.deepcopy(vl)
    enable_packed_attention(packed)
    ids, am, act = _rows([12, 8, 5], seed=3)
    with torch.no_grad():
        want = token_logprobs(vl, ids, am, positions_BT=act)[0]
        got = _packed(packed, ids, am, act)
    torch.testing.assert_close(got[act.bool()], want[act.bool()], **LOGP)


def test_the_packed_forward_survives_train_and_eval_switches(tmp_path):
    """transformers re-kernelizes a loaded model whose train/eval mode changes (the training strategy
    calls train()), dropping a layer's own forward: the packed forward must still be there after."""
    from transformers import AutoModelForCausalLM

    from tests.engine.helpers import tiny_moe
    from tidal.models.varlen import enable_packed_attention

    tiny_moe("qwen3_5_moe").save_pretrained(tmp_path)
    model = enable_packed_attention(AutoModelForCausalLM.from_pretrained(tmp_path))
    model.train()
    model.eval()
    model.train()
    layer = model.model.layers[0].linear_attn
    assert layer.forward.__func__.__name__ == "packed_gated_deltanet_forward"
