"""Vision-language model path: one logprob code path for text and image rows equals the HF forward,
the HF engine's sampling logprobs from image prompts equal the trainer's, batching of pixel inputs,
and backends without image support refuse a VL model."""

import pytest
import torch

from tests.reference import reference_logprobs
from tidal.distributed.generate import gather_and_generate
from tidal.engine.base import Completion, SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.factory import create_engine
from tidal.engine.hf import HFEngine
from tidal.models import load_causal_lm
from tidal.models.logprobs import token_logprobs
from tidal.models.lora import AdapterDisabledReference, apply_lora, hf_weights
from tidal.models.config import LoraConfig
from tidal.models.vision import collate_mm_inputs
from tidal.trainer.experience import Experience, concat_experiences

from .helpers import assert_completions_match_trainer, padded_batch


def test_collate_concatenates_rows_in_order():
    a = {"pixel_values": torch.ones(2, 3), "image_grid_thw": torch.tensor([[1, 1, 2]])}
    b = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    out = collate_mm_inputs([a, None, b])
    assert out["pixel_values"].tolist() == [[1.0] * 3] * 2 + [[0.0] * 3] * 4
    assert out["image_grid_thw"].tolist() == [[1, 1, 2], [1, 2, 2]]
    assert collate_mm_inputs([None, None]) == {} and collate_mm_inputs(None) == {}


def test_logprobs_of_mixed_batch_equal_hf_forward(vl):
    proc, model, ds = vl
    text_ids = proc.tokenizer("plain text row", add_special_tokens=False)["input_ids"]
    rows = [ds[0].prompt_ids + [23, 2], text_ids, ds[1].prompt_ids + [24]]
    mm_rows = [ds[0].mm_inputs, None, ds[1].mm_inputs]
    ids, am = padded_batch(rows, proc.pad_token_id)
    mm = collate_mm_inputs(mm_rows)
    with torch.no_grad():
        got, _ = token_logprobs(model, ids, am, mm_inputs=mm, chunk_tokens=7)
        image_rows = torch.tensor([0, 2])
        want_img = reference_logprobs(model(input_ids=ids[image_rows], attention_mask=am[image_rows],
                                            mm_token_type_ids=(ids[image_rows] == proc.image_token_id).int(), **mm).logits, ids[image_rows])
        want_txt = reference_logprobs(model(input_ids=ids[1:2], attention_mask=am[1:2]).logits, ids[1:2])
    torch.testing.assert_close(got[image_rows] * am[image_rows], want_img * am[image_rows], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1:2] * am[1:2], want_txt * am[1:2], rtol=1e-4, atol=1e-5)
    # the image matters: the same ids with another image's pixels give other logprobs
    other = collate_mm_inputs([ds[1].mm_inputs, None, ds[0].mm_inputs])
    with torch.no_grad():
        swapped, _ = token_logprobs(model, ids, am, mm_inputs=other)
    assert (swapped[0] - got[0]).abs().max() > 1e-4


def test_hf_engine_logprobs_from_image_prompts_match_trainer(vl):
    proc, model, ds = vl
    eng = HFEngine(model.config, EngineConfig(backend="hf", max_num_seqs=3), device=torch.device("cpu"), dtype=torch.float32)
    eng.load_weights(hf_weights(model, lambda p: p.detach()))
    items = [ds[i] for i in range(3)]
    comps = eng.generate([it.prompt_ids for it in items], SamplingParams(max_new_tokens=3, n=2, seed=5), mm_inputs=[it.mm_inputs for it in items])
    assert len(comps) == 6 and all(c.token_ids for c in comps)
    assert_completions_match_trainer(model, proc.pad_token_id, comps, [items[b // 2].mm_inputs for b in range(6)])


def test_lora_reference_on_vl_model_equals_base(vl, squares_assets):
    proc, _, ds = vl
    base = load_causal_lm(squares_assets.model_path)
    actor = apply_lora(load_causal_lm(squares_assets.model_path), LoraConfig(rank=4), seed=0)
    assert all("language_model" in n for n, p in actor.named_parameters() if p.requires_grad)  # not the vision tower
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    ids, am = padded_batch([ds[0].prompt_ids + [23, 2]], proc.pad_token_id)
    mm = collate_mm_inputs([ds[0].mm_inputs])
    with torch.no_grad():
        ref, _ = token_logprobs(AdapterDisabledReference(actor), ids, am, mm_inputs=mm)
        want, _ = token_logprobs(base, ids, am, mm_inputs=mm)
        on, _ = token_logprobs(actor, ids, am, mm_inputs=mm)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)
    assert (on - want).abs().max() > 1e-4
    names = dict(hf_weights(actor, lambda p: p.detach()))
    assert sorted(names) == sorted(n for n, _ in base.named_parameters())


@pytest.mark.parametrize("backend", ["vllm"])
def test_backends_without_images_refuse_vl_models(vl, backend):
    _, model, _ = vl
    with pytest.raises(ValueError, match="engine.backend=hf"):
        create_engine(model.config, EngineConfig(backend=backend), device=torch.device("cpu"), dtype=torch.float32)


class _RecordingEngine:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, **kw):
        self.calls.append(kw)
        return [Completion(prompt_ids=p, token_ids=[1], logprobs=[0.0], finish_reason="stop") for p in prompts for _ in range(params.n)]


def test_text_prompts_reach_the_engine_without_mm_inputs():
    class RT:
        tp_size = 1

    eng = _RecordingEngine()
    gather_and_generate(eng, [[1], [2]], SamplingParams(), RT(), mm_inputs=[None, None])
    mm = {"pixel_values": torch.zeros(1, 1), "image_grid_thw": torch.ones(1, 3, dtype=torch.long)}
    gather_and_generate(eng, [[1], [2]], SamplingParams(), RT(), mm_inputs=[None, mm])
    assert eng.calls == [{}, {"mm_inputs": [None, mm]}]


def _exp(B, mm):
    z = torch.zeros(B, 3)
    zb = torch.zeros(B)
    return Experience(sequences_BT=z.long(), attention_mask_BT=torch.ones(B, 3), action_mask_BT=z, old_logp_BT=z,
                      rollout_logp_BT=z, advantages_BT=z, returns_BT=z, rewards_B=zb, group_ids_B=zb.long(), loss_mask_B=zb, mm_inputs=mm)


def test_experience_select_and_concat_keep_rows_images():
    a, b = {"pixel_values": torch.ones(1, 1)}, {"pixel_values": torch.zeros(1, 1)}
    e = _exp(3, [a, None, b])
    assert e.select([2, 0]).mm_inputs == [b, a]
    assert e.to(torch.device("cpu")).mm_inputs == [a, None, b]
    cat = concat_experiences([_exp(2, None), e])
    assert cat.mm_inputs == [None, None, a, None, b]
    assert concat_experiences([_exp(1, None), _exp(2, None)]).mm_inputs is None


def test_placeholder_mask_counts_only_image_runs_after_vision_start(vl):
    proc, model, _ = vl
    c = model.config
    vs, img, ve = c.vision_start_token_id, c.image_token_id, c.vision_end_token_id
    ids = torch.tensor([[7, vs, img, img, ve, 8, img, img, vs, img]])
    from tidal.models.vision import placeholder_mask

    assert placeholder_mask(ids, c).tolist() == [[False, False, True, True, False, False, False, False, False, True]]


def test_generated_image_tokens_are_text_to_trainer_and_engine(vl):
    """A sampled <|image_pad|> in a response is embedded as a plain token at decode time; the
    trainer's forward must score it the same way (and must not take it for a placeholder)."""
    proc, model, ds = vl
    item = ds[0]
    response = [proc.image_token_id, 23, proc.image_token_id, 2]
    ids, am = padded_batch([item.prompt_ids + response], proc.pad_token_id)
    mm = collate_mm_inputs([item.mm_inputs])
    from tidal.models.vision import multimodal_body_inputs

    with torch.no_grad():
        got, _ = token_logprobs(model, ids, am, mm_inputs=mm)
        P = len(item.prompt_ids)
        prompt = torch.tensor([item.prompt_ids])
        inputs = multimodal_body_inputs(model, prompt, torch.ones_like(prompt), mm)
        out = model(**inputs, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        pos = int(inputs["position_ids"].amax()) + 1
        want = []
        for k, tok in enumerate(response):  # decode as HFEngine does: one token, text position, no pixels
            want.append(float(torch.log_softmax(logits.float(), -1)[0, tok]))
            step = model(input_ids=torch.tensor([[tok]]), attention_mask=torch.ones(1, P + k + 1, dtype=torch.long),
                         position_ids=torch.tensor([[pos + k]]), past_key_values=past, use_cache=True)
            past, logits = step.past_key_values, step.logits[:, -1]
    torch.testing.assert_close(got[0, P:], torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_qwen2_5_vl_logprobs_equal_hf_forward(qwen2_5_vl):
    """The same path serves Qwen2.5-VL (windowed vision attention, its own get_rope_index)."""
    proc, model, prompts, pixel_inputs = qwen2_5_vl
    ids, am = padded_batch([prompts[0] + [23, 2], prompts[1] + [24]], proc.pad_token_id)
    mm = collate_mm_inputs(pixel_inputs)
    with torch.no_grad():
        got, _ = token_logprobs(model, ids, am, mm_inputs=mm)
        logits = model(input_ids=ids, attention_mask=am, mm_token_type_ids=(ids == proc.image_token_id).int(), **mm).logits
    torch.testing.assert_close(got * am, reference_logprobs(logits, ids) * am, rtol=1e-4, atol=1e-5)
