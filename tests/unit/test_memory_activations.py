"""The memory plan's activation formulas against what a tiny Qwen2 actually keeps, on CPU in bf16
under causal SDPA over unpadded rows (what the packed attention keeps too: training micro-batches
are packed, and on CUDA the flash varlen kernel saves the same q, k, v, output and log-sum-exp;
the CPU's block-diagonal reference with its mask is not counted): the tensors autograd saves for backward (``saved_tensors_hooks``, counted per storage),
and the peak of a training micro-batch and of a no-grad forward through the trainer's own logprob
path (``tests.memory_accounting.LiveBytes``). What differs on a GPU and is not checked here: the
CUDA SDPA kernels (flash / memory-efficient: the same saved tensors, their own workspaces),
``torch.compile``'s fused kernels (its saved set is checked below on CPU), the allocator's
rounding. The GPU figures are checked against measured H200 peaks in test_memory_plan.py."""

import collections

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.memory_accounting import LiveBytes
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.memory.plan import (
    ModelShape,
    forward_activation_bytes,
    layer_backward_bytes,
    layer_saved_bytes,
    lm_head_train_bytes,
    train_activation_bytes,
)

B, T = 4, 64


def _model(layers=2, *, tie=False, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    # distinct H, q, kv, I so that a wrong coefficient cannot be hidden by another
    cfg = Qwen2Config(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=352, num_hidden_layers=layers,
                      vocab_size=256, max_position_embeddings=512, attn_implementation="sdpa", tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).to(dtype), cfg


def _inputs():
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones(B, T, dtype=torch.long)


def _saved_per_layer(model, ids, mask) -> list[float]:
    """Bytes per token saved for backward inside each decoder layer (new storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen, per = ["outside"], set(), collections.Counter()
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *a, i=i: where.__setitem__(0, i))
        layer.register_forward_hook(lambda *a: where.__setitem__(0, "outside"))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and (st.data_ptr(), st.nbytes()) not in seen:
            seen.add((st.data_ptr(), st.nbytes()))
            per[where[0]] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    # the last layer: the first also holds the RoPE tables, shared by all layers
    return [per[i] / (B * T) for i in range(len(model.model.layers))]


def test_saved_tensors_of_a_layer_match_the_formula_eager():
    model, cfg = _model()
    saved = _saved_per_layer(model, *_inputs())
    want = layer_saved_bytes(ModelShape.from_hf_config(cfg), compiled=False)
    assert saved[-1] == want


def test_saved_tensors_with_lora_adapters():
    peft = pytest.importorskip("peft")
    model, cfg = _model(dtype=torch.float32)  # as Tidal does: adapters on the fp32 model, all computing in bf16
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)).get_base_model().to(torch.bfloat16)
    saved = _saved_per_layer(model, *_inputs())
    assert saved[-1] == layer_saved_bytes(ModelShape.from_hf_config(cfg), compiled=False, lora_rank=4, lora_targets=7)


@pytest.mark.slow
def test_saved_tensors_of_a_compiled_layer_match_the_formula():
    """``torch.compile`` (inductor on CPU: the same partitioner as on CUDA) keeps the matmul inputs
    and outputs and recomputes the elementwise ops."""
    torch._dynamo.reset()
    model, cfg = _model()
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    saved = _saved_per_layer(model, *_inputs())
    assert saved[-1] == layer_saved_bytes(ModelShape.from_hf_config(cfg), compiled=True)


def _trainer_path(checkpointing: bool):
    """A tiny actor on the trainer's logprob path (LM head on response tokens only, chunked)."""
    model, cfg = _model(layers=4, tie=True)
    attach_logprob_method(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    prompt = 16
    ids, mask = _inputs()
    act = torch.zeros(B, T, dtype=torch.long)
    act[:, prompt:] = 1
    return model, cfg, ids, mask, act * mask


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_micro_batch_peak(checkpointing):
    """Peak of one forward + backward of a policy-gradient loss, gradients of the parameters left
    out (they are a separate item of the plan, fp32 shards under FSDP2): within 5% of
    saved activations + the larger of the LM head's and a layer's backward."""
    model, cfg, ids, mask, act = _trainer_path(checkpointing)
    chunk = 64

    def step():
        logp, _ = token_logprobs(model, ids, mask, with_entropy=True, chunk_tokens=chunk, positions_BT=act)
        (-(logp * act).sum() / act.sum()).backward()

    step()  # warm: lazily created buffers are not activations
    for p in model.parameters():
        p.grad = None
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    mode = LiveBytes(ignore=[p.untyped_storage().data_ptr() for p in model.parameters()])
    with mode:
        step()
    shape, m = ModelShape.from_hf_config(cfg), int(act.sum())
    kw = dict(compiled=False, checkpointing=checkpointing)
    want = train_activation_bytes(shape, B * T, response_tokens=m, **kw) + max(
        lm_head_train_bytes(shape, min(chunk, m), compiled=False), layer_backward_bytes(shape, B * T, **kw))
    assert mode.peak == pytest.approx(want, rel=0.05)


def test_no_grad_forward_peak():
    model, cfg, ids, mask, act = _trainer_path(False)
    mode = LiveBytes(ignore=[p.untyped_storage().data_ptr() for p in model.parameters()])
    with torch.no_grad(), mode:
        token_logprobs(model, ids, mask, with_entropy=True, chunk_tokens=64, positions_BT=act)
    m = int(act.sum())
    want = forward_activation_bytes(ModelShape.from_hf_config(cfg), B * T, response_tokens=m, chunk_rows=min(64, m),
                                    compiled=False)
    assert mode.peak == pytest.approx(want, rel=0.05)
