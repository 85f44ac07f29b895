"""Exact mode (``numerics.exact``, docs/exact.md): the native engine's sampling logprobs equal the
trainer's logprobs of the same tokens bit for bit (``torch.equal``), for every family exact mode
covers, in fp32 and bf16, whatever the engine's batch (one sequence per step or many), chunked
prefill, prefix hits (GRPO samples sharing their prompt) and the trainer's packing (rows packed
together or alone, in another order); the training forward (autograd on) gives the same bits, so
the first importance ratio is exactly 1. Without exact mode the same comparison fails (the test
has power), and a one-ulp difference fails it too (it is bitwise)."""

import dataclasses

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tidal import families
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.native import NativeEngine
from tidal.models.logprobs import attach_logprob_method, set_exact, token_logprobs
from tidal.models.varlen import enable_packed_attention
from tidal.sampling_filter import SamplingFilter

from .helpers import tiny_moe
from .test_native_qwen3_5 import tiny_qwen3_5

COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=128, max_position_embeddings=256, initializer_range=0.02, head_dim=16)
SLIDING = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])
CONFIGS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(SLIDING, query_pre_attn_scalar=24, final_logit_softcapping=None)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
}
DTYPES = [torch.float32, torch.bfloat16]
# GRPO-shaped: each prompt sampled N times (prefix hits); prompts longer than a prefill chunk
PROMPTS = [list(range(3, 30)), [5, 9, 77, 2, 31], [40, 41, 40, 41, 40, 41, 40, 41, 40, 41, 40]]
N, NEW = 3, 16
_MODELS: dict = {}


def tiny_moe_tied(family: str, dtype: torch.dtype):
    """The family's tiny MoE (tests/engine/helpers.py) whose router rows 1 and 6 are equal in every
    layer, so every token's probabilities of experts 1 and 6 tie exactly (the tie-break decides),
    parameters in ``dtype``, packed and exact."""
    if (family, dtype) not in _MODELS:
        model = tiny_moe(family)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p[6] = p[1]
                p.data = p.data.to(dtype)
        enable_packed_attention(model)
        attach_logprob_method(model)
        _MODELS[family, dtype] = model
    return _MODELS[family, dtype]


def tiny(family: str, dtype: torch.dtype):
    """The family's tiny HF model with random norm weights and biases, its parameters in ``dtype``
    (buffers such as RoPE frequencies stay fp32, as a loaded checkpoint's do), packed and exact."""
    if (family, dtype) not in _MODELS:
        cfg_cls, model_cls, extra = CONFIGS[family]
        torch.manual_seed(0)
        model = model_cls(cfg_cls(**COMMON, **extra)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.normal_(0, 0.3)
                p.data = p.data.to(dtype)
        enable_packed_attention(model)
        attach_logprob_method(model)
        _MODELS[family, dtype] = model
    return _MODELS[family, dtype]


def generate(model, dtype, exact=True, sampling=SamplingFilter(), **engine_cfg):
    """(rows, completions) of the GRPO-shaped batch through a native engine with ``model``'s weights,
    sampled from ``sampling``'s processed distribution."""
    cfg = EngineConfig(**{"block_size": 4, "enable_prefix_caching": True, **engine_cfg})
    engine = NativeEngine(model.config, cfg, device=torch.device("cpu"), dtype=dtype, exact=exact)
    engine.load_weights(model.state_dict().items())
    params = SamplingParams(**dataclasses.asdict(sampling), max_new_tokens=NEW, n=N, seed=3, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    prompts = [p for p in PROMPTS for _ in range(N)]
    return [p + o.token_ids for p, o in zip(prompts, outs)], [torch.tensor(o.logprobs, dtype=torch.float32) for o in outs]


def trainer_logprobs(model, rows, exact=True, grad=False, sampling=SamplingFilter()):
    """Each row's per-token logprobs from the trainer's packed forward (the rows packed together)
    under ``sampling``'s processed distribution."""
    set_exact(model, exact)
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.set_grad_enabled(grad):
        logp_BT, _ = token_logprobs(model, ids, mask, sampling=sampling)
    return [logp_BT[i, len(r) - NEW : len(r)].detach() for i, r in enumerate(rows)]


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", list(CONFIGS))
def test_rollout_logprobs_equal_trainer_logprobs_bitwise(family, dtype):
    assert families.find_family(CONFIGS[family][0]()).exact
    model = tiny(family, dtype)
    rows, rollout = generate(model, dtype)  # all 9 sequences per step; prefix hits within each group
    assert bitwise(rollout, trainer_logprobs(model, rows))
    # one sequence per step, chunked prefill (8-token chunks): the same tokens, the same bits
    rows1, rollout1 = generate(model, dtype, max_num_seqs=1, max_num_batched_tokens=8)
    assert rows1 == rows and bitwise(rollout1, rollout)
    # the trainer packing other row sets: each row alone, and reversed
    assert bitwise(rollout[:1], trainer_logprobs(model, rows[:1]))
    assert bitwise(rollout[::-1], trainer_logprobs(model, rows[::-1]))


FILTERED = SamplingFilter(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_filtered_rollout_logprobs_equal_trainer_logprobs_bitwise(family, dtype):
    """With temperature, top-k, top-p and min-p the engine samples from, and the trainer scores,
    one processed distribution (tidal/sampling_filter.py): the same bits too."""
    model = tiny(family, dtype)
    rows, rollout = generate(model, dtype, sampling=FILTERED)
    assert bitwise(rollout, trainer_logprobs(model, rows, sampling=FILTERED))
    rows1, rollout1 = generate(model, dtype, sampling=FILTERED, max_num_seqs=1, max_num_batched_tokens=8)
    assert rows1 == rows and bitwise(rollout1, rollout)
    assert not bitwise(rollout, trainer_logprobs(model, rows))  # scored without the filter: other numbers


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen3_5_moe"])
def test_moe_rollout_logprobs_equal_trainer_logprobs_bitwise(family, dtype):
    """MoE routing included: the router's top-k breaks ties by the lowest expert index on both sides
    (experts 1 and 6 tie for every token here), each expert's rows go through the invariant matmul
    and a token's expert outputs add in expert order on both sides."""
    model = tiny_moe_tied(family, dtype)
    assert families.find_family(model.config).exact
    rows, rollout = generate(model, dtype)
    assert bitwise(rollout, trainer_logprobs(model, rows))
    assert bitwise(rollout[::-1], trainer_logprobs(model, rows[::-1]))
    rows1, rollout1 = generate(model, dtype, max_num_seqs=1, max_num_batched_tokens=8)
    assert rows1 == rows and bitwise(rollout1, rollout)


def tiny_hybrid(dtype: torch.dtype):
    """Qwen3.5's tiny hybrid (tests/engine/test_native_qwen3_5.py), parameters in ``dtype``, packed."""
    if ("qwen3_5", dtype) not in _MODELS:
        model = tiny_qwen3_5()
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(dtype)
        enable_packed_attention(model)
        attach_logprob_method(model)
        _MODELS["qwen3_5", dtype] = model
    return _MODELS["qwen3_5", dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_deltanet_rollout_logprobs_equal_trainer_logprobs_bitwise(dtype):
    """Qwen3.5 (two Gated DeltaNet layers, then gated full attention): one form of the delta rule on
    both sides, the recurrent one (prefill, chunked prefill, decode and packed training alike), and
    one form of the short convolution (each output from its window of K inputs)."""
    model = tiny_hybrid(dtype)
    assert families.find_family(model.config).exact
    rows, rollout = generate(model, dtype)
    assert bitwise(rollout, trainer_logprobs(model, rows))
    assert bitwise(rollout[::-1], trainer_logprobs(model, rows[::-1]))
    rows1, rollout1 = generate(model, dtype, max_num_seqs=1, max_num_batched_tokens=8)
    assert rows1 == rows and bitwise(rollout1, rollout)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_5"])
def test_training_forward_gives_the_old_logprobs(family):
    """The update's forward (autograd on) computes the same bits: the first ratio is exactly 1, and
    gradients flow through exact mode's ops."""
    model = tiny_hybrid(torch.float32) if family == "qwen3_5" else tiny(family, torch.float32)
    rows, rollout = generate(model, torch.float32)
    set_exact(model, True)
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    model.zero_grad()
    logp_BT, _ = token_logprobs(model, ids, mask)
    new = [logp_BT[i, len(r) - NEW : len(r)] for i, r in enumerate(rows)]
    assert bitwise([x.detach() for x in new], rollout)
    ratio = torch.exp(torch.cat(new) - torch.cat(rollout))
    assert torch.equal(ratio, torch.ones_like(ratio))
    torch.cat(new).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def test_default_mode_is_not_bitwise_and_one_ulp_fails():
    """The comparison has power: without exact mode (either side) the same tokens' logprobs differ
    in the last bits; and a single logprob moved by one ulp is caught."""
    model = tiny("qwen3", torch.float32)
    rows, rollout = generate(model, torch.float32)
    assert not bitwise(rollout, trainer_logprobs(model, rows, exact=False))
    rows_d, rollout_d = generate(model, torch.float32, exact=False)
    assert not bitwise(rollout_d, trainer_logprobs(model, rows_d))
    nudged = [x.clone() for x in rollout]
    nudged[4][7] = torch.nextafter(nudged[4][7], torch.tensor(0.0))
    assert not bitwise(nudged, trainer_logprobs(model, rows))
    assert (nudged[4] - rollout[4]).abs().max() > 0  # the logged mismatch would not be 0
