"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) in the native engine against transformers
on a tiny random model (CPU, fp32): logits at every prefill and decode position, forked samples,
preemption, a multi-turn continuation, greedy outputs."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from tidal.engine.base import Request, SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.native import NativeEngine
from tidal.engine.native.attention import AttnMetadata
from tidal.engine.native.state_pool import StatePool

from ..tolerance import rounding_tol

TEXT = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=128, max_position_embeddings=256, initializer_range=0.2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
)
PROMPTS = [[3, 17, 99, 5, 42, 8, 61, 30, 2, 77, 4], [11, 12], list(range(20, 41)), [7]]


def _randomize(model):
    """HF initialises the norms to 0/1 and A_log, dt_bias to fixed values: make every weight matter."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def tiny_qwen3_5() -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT)).eval()
    _randomize(model)
    return model


@pytest.fixture(scope="module")
def hf():
    return tiny_qwen3_5()


def _engine(hf_model, **cfg) -> NativeEngine:
    engine = NativeEngine(hf_model.config, EngineConfig(**{"block_size": 4, "max_num_batched_tokens": 16, **cfg}),
                          device=torch.device("cpu"), dtype=torch.float32)
    engine.load_weights(hf_model.state_dict().items())
    return engine


@pytest.fixture(scope="module")
def engine(hf):
    return _engine(hf)


@torch.no_grad()
def _hf_logp(hf_model, tokens):
    return torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].double(), -1)


def _assert_logprobs(hf_model, completion):
    """Each sampled token's logprob equals HF's log-softmax at its position."""
    ref_TV = _hf_logp(hf_model, completion.prompt_ids + completion.token_ids)[len(completion.prompt_ids) - 1 : -1]
    ref = ref_TV.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    got = torch.tensor(completion.logprobs, dtype=torch.float64)
    assert (got - ref).abs().max().item() <= rounding_tol(torch.float32, ref_TV), (got, ref)


@torch.no_grad()
def test_logits_at_every_prefill_and_decode_position(hf):
    """Chunked prefill (state carried between chunks) then decode steps, run through the engine's
    model on slot 1 of a state pool: every position's logits equal HF's forward."""
    model = _engine(hf).model
    tokens = PROMPTS[2] + [5, 9, 60]
    ref = hf(torch.tensor([tokens])).logits[0]
    for attn in model.layer_attentions():  # 16 blocks of 4 tokens, block i at cache block i
        attn.k_cache, attn.v_cache = torch.zeros(2, 16, 4, attn.num_kv_heads, attn.head_dim).unbind(0)
    StatePool(model.linear_layers(), 2, torch.device("cpu"))
    got, start, bt = [], 0, torch.arange(16, dtype=torch.int32)[None]
    for n in (5, 9, 7, 1, 1, 1):  # three prefill chunks, three decode steps
        pos = torch.arange(start, start + n)
        meta = AttnMetadata(is_prefill=n > 1, slot_mapping_T=pos, block_tables_BN=bt,
                            context_lens_B=torch.tensor([start + n], dtype=torch.int32),
                            cu_seqlens_q_B1=torch.tensor([0, n], dtype=torch.int32), query_lens=[n],
                            context_lens=[start + n], max_query_len=n, max_context_len=start + n,
                            state_slots_B=torch.tensor([1]), state_slots=[1])
        got.append(model.compute_logits(model(torch.tensor(tokens[start : start + n]), pos, meta)))
        start += n
    got = torch.cat(got)
    assert got.shape == ref.shape and (got - ref).abs().max().item() <= rounding_tol(torch.float32, ref)


def test_greedy_64_tokens_equal_hf_generate(hf, engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True))
    for prompt, c in zip(PROMPTS, out):  # each token is HF's argmax after the ones before it
        logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        assert c.token_ids == logits.argmax(-1).tolist()
    for prompt, c in list(zip(PROMPTS, out))[1:2]:  # and HF's own generate (its cached decode) agrees
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert c.token_ids == ref
    _assert_logprobs(hf, out[0])


def test_forked_samples_prefill_once_and_equal_hf(hf, engine):
    """A group's samples fork from the first one's checkpoint: the prompt is prefilled about once
    (each other sample computes only its last block), and every sample's logprobs are HF's."""
    before = dict(engine.stats)
    n, prompt = 4, PROMPTS[2]  # 21 tokens: 5 full blocks before the last token
    out = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=12, n=n, seed=5, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in out}) > 1
    for c in out:
        _assert_logprobs(hf, c)
    prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled == len(prompt) + (n - 1) * (len(prompt) - 20)
    assert engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == (n - 1) * 20


def test_wrong_fork_copy_fails(hf):
    """The checkpoint a fork copies is what makes its logprobs right: a pool whose copies drop the
    delta-rule state (zeros instead) gives wrong logprobs."""
    engine = _engine(hf)
    engine._ensure_kv([64] * 4)
    pool = engine.runner.states
    real_apply = pool.apply

    def broken_apply():
        copies = pool._copies
        pool._copies = [(-1, dst) for _, dst in copies]
        real_apply()

    pool.apply = broken_apply
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=5, ignore_eos=True))
    with pytest.raises(AssertionError):
        for c in out:
            _assert_logprobs(hf, c)


def test_preempted_and_resumed_sequences_equal_hf(hf):
    # 10 blocks of 4 tokens cannot hold 4 sequences growing to ~30 tokens: preemption
    engine = _engine(hf, kv_cache_max_tokens=40, max_num_seqs=4)
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=14, seed=2, ignore_eos=True))
    assert engine.stats["preemptions"] > 0
    for c in out:
        _assert_logprobs(hf, c)


def test_multi_turn_continues_from_checkpoint(hf, engine):
    """The next turn's prompt extends the previous turn's tokens: it starts from the state
    checkpointed at the last block boundary of the previous turn and computes only the rest."""
    (turn1,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True))
    prompt2 = turn1.prompt_ids + turn1.token_ids + [9, 8, 7, 6, 5]
    before = dict(engine.stats)
    (turn2,) = engine.generate([prompt2], SamplingParams(temperature=1.0, max_new_tokens=10, seed=4, ignore_eos=True))
    _assert_logprobs(hf, turn2)
    # turn 1 decoded up to 20 tokens: checkpoints at 12, 16 and 20 (the last full block before turn 2's last token)
    assert engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 20
    assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == len(prompt2) - 20


def test_abort_mid_flight_keeps_survivors_exact(hf):
    """An abort drops the decode step in flight; the sequences that go on re-prefill instead of
    applying that token to their state twice."""
    engine = _engine(hf)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, ignore_eos=True)
    engine.add([Request(request_id=i, prompt_ids=p, params=params) for i, p in enumerate(PROMPTS[:3])])
    for _ in range(4):
        engine.step()
    assert engine._pending is not None
    (aborted,) = engine.abort([1])
    assert aborted.finish_reason == "abort"
    assert engine.scheduler.num_preemptions == 3  # the rows of the dropped step (then one aborted)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(c.request_id for c in done) == [0, 2]
    for c in done:
        _assert_logprobs(hf, c)


def test_conditional_generation_checkpoint_text_tower(hf):
    """A Qwen3_5ForConditionalGeneration's weights (model.language_model.*, the vision tower
    skipped) load into the same engine model."""
    torch.manual_seed(0)
    vl = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=dict(depth=1, hidden_size=32,
                                         intermediate_size=32, num_heads=2, out_hidden_size=64))).eval()
    vl.model.language_model.load_state_dict(hf.model.state_dict())
    vl.lm_head.load_state_dict(hf.lm_head.state_dict())
    engine = NativeEngine(vl.config, EngineConfig(block_size=4), device=torch.device("cpu"), dtype=torch.float32)
    engine.load_weights(vl.state_dict().items())
    assert engine.verify_weights(vl.state_dict().items()) == []
    (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    _assert_logprobs(hf, c)


def test_speculative_is_a_config_error(hf):
    with pytest.raises(Exception, match="engine.speculative"):
        NativeEngine(hf.config, EngineConfig(speculative="on"), device=torch.device("cpu"), dtype=torch.float32)


def test_images_are_refused_as_text_only(hf, engine):
    with pytest.raises(ValueError, match="text tower alone"):
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2), mm_inputs=[{"pixel_values": torch.zeros(1, 4)}])


TP_PARAMS = [SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True),
             SamplingParams(temperature=0.8, max_new_tokens=8, n=3, seed=5, ignore_eos=True)]


def _tp_worker(rank: int, store_path: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    hf_model = tiny_qwen3_5()
    engine = NativeEngine(hf_model.config, EngineConfig(block_size=4, max_num_batched_tokens=16), device=torch.device("cpu"),
                          dtype=torch.float32, tp_group=dist.new_group([0, 1]))
    engine.load_weights(hf_model.state_dict().items())
    gdn = engine.model.linear_layers()[0]
    assert gdn.hv == 2 and gdn.conv1d.weight.shape[0] == (2 * 2 * 8 + 4 * 16) // 2  # q, k, v sections halved
    out = [[(c.token_ids, c.logprobs) for c in engine.generate(PROMPTS, p)] for p in TP_PARAMS]
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_gloo_equals_tp1(hf, tmp_path):
    """Gated DeltaNet heads, its fused projections' sections and conv channels sharded over 2 ranks."""
    mp.start_processes(_tp_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0 == r1
    tp1 = [[(c.token_ids, c.logprobs) for c in _engine(hf).generate(PROMPTS, p)] for p in TP_PARAMS]
    for runs1, runs2 in zip(tp1, r0):
        assert [t for t, _ in runs1] == [t for t, _ in runs2]
        for (_, lp1), (_, lp2) in zip(runs1, runs2):
            assert torch.allclose(torch.tensor(lp1), torch.tensor(lp2), atol=1e-4)
