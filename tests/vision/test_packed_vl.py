"""Packed forwards of vision-language rows equal padded ones (fp32, CPU): Qwen2-VL and Qwen2.5-VL
M-RoPE positions per sequence, image rows mixed with text rows and a generated (stray) image token,
and gradients of every parameter, the vision tower's included. Tolerances: logprobs atol 1e-5,
gradients atol 1e-5 / rtol 1e-4."""

import copy

import torch

from tidal.models.logprobs import token_logprobs
from tidal.models.packing import PackedBatch
from tidal.models.varlen import enable_packed_attention
from tidal.models.vision import collate_mm_inputs

from .helpers import padded_batch


def _packed_copy(model):
    packed = copy.deepcopy(model)
    enable_packed_attention(packed)
    assert packed.model.visual.config._attn_implementation != "tidal_varlen"  # the tower keeps its attention
    return packed


def _logprobs_and_grads(model, ids, am, act, mm, packed):
    model.zero_grad(set_to_none=True)
    kw = dict(packed=PackedBatch.build(ids, am, targets_BT=act)) if packed else dict(positions_BT=act)
    logp, ent = token_logprobs(model, ids, am, mm_inputs=mm, with_entropy=True, chunk_tokens=5, **kw)
    (-(logp * act).sum() - 0.1 * ent.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, ids, am, act, mm):
    want_logp, want = _logprobs_and_grads(model, ids, am, act, mm, packed=False)
    got_logp, got = _logprobs_and_grads(_packed_copy(model), ids, am, act, mm, packed=True)
    torch.testing.assert_close(got_logp, want_logp, atol=1e-5, rtol=1e-5)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=n)
    return want


def test_qwen2_vl_mixed_image_and_text_rows(vl):
    proc, model, ds = vl
    text_ids = proc.tokenizer("plain text row", add_special_tokens=False)["input_ids"]
    stray = proc.image_token_id  # a generated image token is text to the trainer
    rows = [ds[0].prompt_ids + [23, stray, 2], text_ids + [25, 26], ds[1].prompt_ids + [24]]
    prompts = [len(ds[0].prompt_ids), len(text_ids), len(ds[1].prompt_ids)]
    ids, am = padded_batch(rows, proc.pad_token_id)
    act = (am.bool() & (torch.arange(ids.shape[1])[None] >= torch.tensor(prompts)[:, None])).float()
    grads = _assert_same(model, ids, am, act, collate_mm_inputs([ds[0].mm_inputs, None, ds[1].mm_inputs]))
    assert any(n.startswith("model.visual.") and g.abs().sum() > 0 for n, g in grads.items())  # the images matter


def test_text_rows_on_a_vl_model(vl):
    proc, model, _ = vl
    rows = [proc.tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("one text row", "and a second, longer one")]
    ids, am = padded_batch(rows, proc.pad_token_id)
    act = am.float()
    act[:, :2] = 0
    _assert_same(model, ids, am, act, collate_mm_inputs([None, None]))


def test_qwen2_5_vl_rows(qwen2_5_vl):
    proc, model, prompts, pixel_inputs = qwen2_5_vl
    rows = [prompts[0] + [23, 2], prompts[1] + [24]]
    ids, am = padded_batch(rows, proc.pad_token_id)
    act = am.float()
    for b, p in enumerate(prompts):
        act[b, : len(p)] = 0
    _assert_same(model, ids, am, act, collate_mm_inputs(pixel_inputs))
