"""The native engine against Hugging Face for each family it runs (CPU, fp32), on tiny random
configs built by ``transformers`` itself: Qwen3 (the baseline, full attention), Gemma 3 and OLMo 3
(sliding-window layers interleaved with full ones; a window of 8 tokens, which every prompt here
crosses). Logits at every sampled position, greedy 64-token outputs, forked samples, a preempted
and resumed sequence, a multi-turn continuation; a window off by one fails."""

import copy

import pytest
import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Olmo3Config,
    Olmo3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.tolerance import rounding_tol
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.native import NativeEngine
from tidal.engine.sampler import process_logits

from .helpers import OracleDrafter, engine_for, hf_greedy

COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=128, max_position_embeddings=256, initializer_range=0.02, head_dim=16)
WINDOW = 8
SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
CONFIGS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        SLIDING, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "olmo3": (Olmo3Config, Olmo3ForCausalLM, dict(
        SLIDING, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}
FAMILIES = list(CONFIGS)
WINDOWED = ["gemma3", "olmo3"]
PROMPTS = [list(range(3, 23)), [5, 9, 77, 2, 31], [40, 41, 40, 41, 40, 41, 40, 41, 40, 41, 40]]
_MODELS: dict = {}


def tiny(family: str):
    """The family's tiny HF model (built once per session): random norm weights too (HF initialises
    them to 1, or to 0 for Gemma's 1 + w), so that every norm's weight placement matters."""
    if family not in _MODELS:
        cfg_cls, model_cls, extra = CONFIGS[family]
        torch.manual_seed(0)
        model = model_cls(cfg_cls(**COMMON, **extra)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
        model.generation_config.eos_token_id = None
        _MODELS[family] = model
    return _MODELS[family]


def recording(engine: NativeEngine) -> list[torch.Tensor]:
    """The logits ``[rows, V]`` of each step the engine samples from, in step order."""
    steps, compute = [], engine.model.compute_logits

    def compute_and_record(hidden_BH):
        logits = compute(hidden_BH)
        steps.append(logits.detach().clone())
        return logits

    engine.model.compute_logits = compute_and_record
    return steps


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def assert_logits_close(got: torch.Tensor, want: torch.Tensor):
    tol = rounding_tol(torch.float32, want)
    err = (got - want).abs().max().item()
    assert err <= tol, f"max |engine - HF| = {err:.3g} > {tol:.3g}"


def assert_logprobs_match(hf, prompt, tokens, logprobs, temperature=0.0):
    logits = hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1]
    want = process_logits(logits, temperature, 0, 1.0).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    assert_logits_close(torch.tensor(logprobs, dtype=torch.float32), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_every_position_equal_hf(family):
    """One sequence, its 20-token prompt prefilled in chunks of 6 (crossing the window), then decoded:
    each step's full logits row equals HF's forward at that position."""
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=6)
    steps = recording(engine)
    prompt = PROMPTS[0]
    (c,) = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    assert engine.stats["prefill_steps"] == 4 and len(steps) == 16
    want = hf_logits(hf, prompt + c.token_ids)[len(prompt) - 1 : -1]
    assert_logits_close(torch.cat(steps), want)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_64_tokens_equal_hf_generate(family):
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=16)
    out = engine.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    for prompt, c in zip(PROMPTS, out):
        assert c.token_ids == hf_greedy(hf, prompt, 64)
    assert len(set(out[0].token_ids)) > 5  # the model does not collapse onto one token


@pytest.mark.parametrize("family", FAMILIES)
def test_forked_samples_prefill_once_and_match_hf(family):
    hf = tiny(family)
    engine = engine_for(hf, block_size=4)
    prompt = PROMPTS[0]  # 20 tokens: 4 full blocks precede the last token
    out = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=3, ignore_eos=True))
    assert engine.stats["prefix_hit_tokens"] == 3 * 16 and len({tuple(c.token_ids) for c in out}) > 1
    for c in out:
        assert_logprobs_match(hf, prompt, c.token_ids, c.logprobs, temperature=1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_and_resumed_sequences_match_hf(family):
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, kv_cache_max_tokens=48)  # 12 blocks: 3 sequences of ~30 tokens cannot run at once
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True))
    assert engine.stats["preemptions"] > 0
    for prompt, c in zip(PROMPTS, out):
        assert c.token_ids == hf_greedy(hf, prompt, 14)
        assert_logprobs_match(hf, prompt, c.token_ids, c.logprobs)


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_continuation_matches_hf(family):
    """Turn 2's prompt extends turn 1's tokens (token-in/token-out): it continues from the cached
    KV of turn 1 (prefix hits) and its logits equal HF's forward over the whole conversation."""
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, kv_cache_max_tokens=256)  # a fixed cache: kept between the calls
    greedy = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    (t1,) = engine.generate([PROMPTS[1]], greedy)
    steps = recording(engine)
    prompt2 = PROMPTS[1] + t1.token_ids + [7, 8, 9]
    hits = engine.stats["prefix_hit_tokens"]
    (t2,) = engine.generate([prompt2], greedy)
    assert engine.stats["prefix_hit_tokens"] - hits == 3 * 4  # the full blocks of turn 1's 14 computed tokens (its last was never fed)
    want = hf_logits(hf, prompt2 + t2.token_ids)[len(prompt2) - 1 : -1]
    assert_logits_close(torch.cat(steps), want)


@pytest.mark.parametrize("family", WINDOWED)
def test_speculative_verify_keeps_windowed_outputs_exact(family):
    """Verify rows attend within their own window (each drafted position is a decode row of its own
    length): drafts that partly match change neither the greedy tokens nor their logprobs."""
    hf = tiny(family)
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    refs = {tuple(p): hf_greedy(hf, p, 16) for p in PROMPTS[:2]}
    engine = engine_for(hf, block_size=4, speculative="on")
    engine.spec.index = OracleDrafter(refs, "partly", COMMON["vocab_size"])
    out = engine.generate(PROMPTS[:2], greedy)
    assert 0 < engine.stats["spec_accepted"] < engine.stats["spec_drafted"]
    for prompt, c in zip(PROMPTS, out):
        assert c.token_ids == refs[tuple(prompt)]
        assert_logprobs_match(hf, prompt, c.token_ids, c.logprobs)


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize("off_by", [-1, 1])
def test_a_window_off_by_one_fails(family, off_by):
    """The same weights with ``sliding_window`` one token shorter or longer than HF's: the logits
    past the window differ by far more than the tolerance (so the tests above would catch it)."""
    hf = tiny(family)
    cfg = copy.deepcopy(hf.config)
    cfg.sliding_window = WINDOW + off_by
    engine = NativeEngine(cfg, EngineConfig(block_size=4), device=torch.device("cpu"), dtype=torch.float32)
    engine.load_weights(hf.state_dict().items())
    steps = recording(engine)
    prompt = PROMPTS[0]
    (c,) = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    want = hf_logits(hf, prompt + c.token_ids)[len(prompt) - 1 : -1]
    assert (torch.cat(steps) - want).abs().max().item() > 1000 * rounding_tol(torch.float32, want)


def test_gemma3_conditional_generation_runs_its_text_tower():
    """A ``Gemma3ForConditionalGeneration`` checkpoint (text under ``model.language_model``, a vision
    tower): the engine builds the text decoder only, loads the text weights, skips the vision ones,
    and generates what the text model generates."""
    text = tiny("gemma3")
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4)
    cfg = Gemma3Config(text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    vl = Gemma3ForConditionalGeneration(cfg).eval()
    missing = vl.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in text.state_dict().items()
                                                       if k.startswith("model.")}, strict=False)
    assert not missing.missing_keys
    engine = NativeEngine(cfg, EngineConfig(block_size=4), device=torch.device("cpu"), dtype=torch.float32)
    loaded = engine.model.load_weights(vl.state_dict().items())
    assert any(n.startswith("model.language_model.") for n in loaded) and not any("vision" in n for n in loaded)
    assert not any("vision" in n for n, _ in engine.model.named_parameters())
    assert not engine.model.verify_weights(vl.state_dict().items())
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    assert c.token_ids == hf_greedy(text, PROMPTS[0], 12)


def test_gemma3_conditional_generation_trains_its_text_tower(tmp_path):
    """The trainer loads a Gemma3ForConditionalGeneration folder (saved in transformers' on-disk
    layout, ``language_model.model.*``) as its text decoder (text-only RL): the text weights are the
    checkpoint's, the vision tower is not loaded, and its logits are the full model's on text (HF's
    ForConditionalGeneration applies no final_logit_softcapping: none is set here)."""
    from tidal.models.loading import load_causal_lm

    text = dict(tiny("gemma3").config.to_dict(), final_logit_softcapping=None)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4)
    vl = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    vl.save_pretrained(tmp_path)
    actor = load_causal_lm(str(tmp_path)).eval()
    assert type(actor).__name__ == "Gemma3ForCausalLM" and not any("vision" in n for n, _ in actor.named_parameters())
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert_logits_close(actor(ids).logits[0], vl(input_ids=ids).logits[0])
    engine = NativeEngine.from_pretrained(str(tmp_path), EngineConfig(block_size=4), device=torch.device("cpu"),
                                          dtype=torch.float32)  # reads the same on-disk names
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert c.token_ids == hf_greedy(actor, PROMPTS[0], 8)
