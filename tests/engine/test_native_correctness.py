"""The native engine against Hugging Face on tiny random models (CPU, fp32)."""

import math

import pytest
import torch

from tidal.engine.base import SamplingParams
from tidal.engine.sampler import process_logits

from .helpers import PROMPTS, engine_for, hf_greedy, tiny_hf


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_greedy_equals_hf_generate(family):
    hf = tiny_hf(family)
    # small blocks and token budget: paging, chunked prefill and mixed lengths all take part
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=16)
    n_new = 10
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True))
    assert [o.prompt_ids for o in out] == PROMPTS
    for prompt, completion in zip(PROMPTS, out):
        assert completion.token_ids == hf_greedy(hf, prompt, n_new)
        assert completion.finish_reason == "length"
    # greedy logprobs are those of the untempered softmax
    ref = torch.log_softmax(hf(torch.tensor([PROMPTS[0] + out[0].token_ids])).logits[0].double(), -1)
    expect = ref[len(PROMPTS[0]) - 1 : -1].gather(-1, torch.tensor(out[0].token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(out[0].logprobs, dtype=torch.float64), expect, atol=1e-4)


def _reference_logprobs(hf, prompt, tokens, temperature, top_k, top_p):
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = process_logits(logits, temperature, top_k, top_p)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampled_logprobs_equal_reference_forward(temperature, top_k, top_p):
    hf = tiny_hf("qwen2")
    engine = engine_for(hf)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, n=3, seed=1,
                            ignore_eos=True)
    out = engine.generate(PROMPTS[:2], params)
    assert len(out) == 6 and [o.prompt_ids for o in out] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    for c in out:
        ref = _reference_logprobs(hf, c.prompt_ids, c.token_ids, temperature, top_k, top_p)
        assert torch.isfinite(ref).all()  # every sampled token lies in the processed support
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_seed_reproducible_and_samples_differ():
    engine = engine_for(tiny_hf("qwen2"))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=3, ignore_eos=True)
    a = engine.generate([PROMPTS[0]], params)
    b = engine.generate([PROMPTS[0]], params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) > 1


def test_stop_token_ends_sequence_like_hf():
    hf = tiny_hf("qwen2")
    free = hf_greedy(hf, PROMPTS[0], 10)
    stop = free[4]
    first = free.index(stop)
    engine = engine_for(hf)
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,)))
    assert c.token_ids == free[: first + 1] and c.finish_reason == "stop"
    # ignore_eos keeps the model's EOS from stopping, explicit stop ids still stop
    hf.config.eos_token_id = stop
    engine = engine_for(hf)
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10))
    assert c.token_ids == free[: first + 1] and c.finish_reason == "stop"
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    assert c.token_ids == free and c.finish_reason == "length"


def test_preemption_keeps_outputs_exact():
    hf = tiny_hf("llama")
    n_new = 12
    # 12 blocks of 4 tokens cannot hold 4 sequences of ~20 tokens: the scheduler must preempt
    engine = engine_for(hf, block_size=4, kv_cache_max_tokens=48)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:5], [9, 8, 7, 6]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True))
    assert engine.stats["preemptions"] > 0
    for p, c in zip(prompts, out):
        assert c.token_ids == hf_greedy(hf, p, n_new)
        ref = _reference_logprobs(hf, p, c.token_ids, 0, 0, 1.0)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_n_samples_share_the_prompt_prefill():
    engine = engine_for(tiny_hf("qwen2"), block_size=4)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks precede the last token
    engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=3, n=4, seed=0, ignore_eos=True))
    # sample 0 computes all 17 prompt tokens; samples 1-3 reuse 4 blocks (16 tokens) and compute 1
    assert engine.stats["prefix_hit_tokens"] == 3 * 16
    assert engine.stats["prefill_tokens"] == 17 + 3 * 1
    assert engine.stats["prefill_steps"] == 1


def test_from_pretrained_reads_safetensors(tmp_path):
    hf = tiny_hf("qwen3")
    hf.save_pretrained(tmp_path)
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    engine = NativeEngine.from_pretrained(str(tmp_path), EngineConfig(block_size=8), device=torch.device("cpu"),
                                          dtype=torch.float32)
    (c,) = engine.generate([PROMPTS[2]], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert c.token_ids == hf_greedy(hf, PROMPTS[2], 6)


def test_unknown_weight_name_is_rejected():
    engine = engine_for(tiny_hf("qwen2"))
    with pytest.raises(KeyError, match="model.layers.0.self_attn.qkv.weight"):
        engine.load_weights([("model.layers.0.self_attn.qkv.weight", torch.zeros(1))])
    assert math.isfinite(engine.generate([[1, 2]], SamplingParams(temperature=0, max_new_tokens=1))[0].logprobs[0])


def test_overlap_scheduling_changes_nothing_but_the_step_order():
    hf = tiny_hf("qwen3")
    free = hf_greedy(hf, PROMPTS[0], 12)
    stops = (free[3], free[7])  # some sequences stop early: the steps ahead carry void rows
    greedy = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=stops)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=4, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        # a small token budget: the prefill spans steps, the next prefill is scheduled ahead too
        engine = engine_for(hf, overlap_scheduling=overlap, max_num_batched_tokens=8)
        results[overlap] = [[(c.token_ids, c.logprobs, c.finish_reason) for c in engine.generate(PROMPTS, p)]
                            for p in (greedy, sampled)]
        assert (engine.stats["ahead_steps"] > 0) == overlap
        assert engine.stats["prefill_steps"] > 2 * 2
        # every decode step ran ahead: the first one after the prompts' last prefill too, and the
        # steps after sequences stopped
        assert engine.overlap(dict.fromkeys(engine.stats, 0))["ahead_frac"] == (1.0 if overlap else 0.0)
    # same tokens and stops; logprobs equal up to float rounding (a step ahead has other batch rows,
    # so the CPU matmuls may block differently)
    for got, want in zip(results[True], results[False]):
        assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
        for (_, lp_got, _), (_, lp_want, _) in zip(got, want):
            assert lp_got == pytest.approx(lp_want, abs=1e-5)
    assert {c[2] for c in results[True][0]} == {"stop", "length"}


def test_overlap_with_sequences_waiting_behind_the_cap_changes_nothing():
    """12 sequences, 4 at a time, none can stop: while the cap is reached and no running sequence
    reaches its length, the decode runs ahead although sequences wait; the outputs are those of one
    step at a time."""
    hf = tiny_hf("qwen3")
    params = SamplingParams(temperature=1.0, max_new_tokens=9, n=3, seed=2, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        engine = engine_for(hf, overlap_scheduling=overlap, max_num_seqs=4)
        results[overlap] = [(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, params)]
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    for (_, got), (_, want) in zip(results[True], results[False]):
        assert got == pytest.approx(want, abs=1e-5)
    frac = engine.overlap(dict.fromkeys(engine.stats, 0))
    # each wave of 4: its last decode step is not run ahead of the one before (it finishes them
    # by length, and then the next wave may be admitted)
    assert engine.stats["ahead_off_waiting"] > 0 and frac["ahead_frac"] >= 0.8, (frac, engine.stats)


def test_prefix_caching_off_recomputes_every_prompt():
    hf = tiny_hf("qwen2")
    prompt = list(range(1, 18))
    params = SamplingParams(temperature=0, max_new_tokens=4, n=3, ignore_eos=True)
    on, off = engine_for(hf), engine_for(hf, enable_prefix_caching=False)
    assert [c.token_ids for c in on.generate([prompt], params)] == [c.token_ids for c in off.generate([prompt], params)]
    assert off.stats["prefix_hit_tokens"] == 0 and off.stats["prefill_tokens"] == 3 * 17
    assert on.stats["prefix_hit_tokens"] == 2 * 16
