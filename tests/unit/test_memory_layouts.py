"""Each backend's own description of its bytes (``FSDP2Layout``, the memory plan's source) against
what a tiny model allocates on CPU through the strategy, counted by the profiler's record of every
allocation (``tests.memory_accounting.allocation_peak``): the gradients after a synced backward
and while micro-batches accumulate, the optimizer state, the master weights; the update phase's
activations, LM head and gathered layers; and checkpointed layers left eager. What needs a GPU
(the flash kernels' workspaces, the allocator's slack, compiled kernels) is checked on the H200 by
bench/memory_check.py."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.memory_accounting import allocation_peak
from tidal.distributed.runtime import init_runtime, shutdown
from tidal.memory.plan import ModelShape, lm_head_train_bytes, layer_backward_bytes, train_activation_bytes
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy, memory_layout
from tidal.strategy.fsdp2 import checkpointed, compile_layers

B, T, PROMPT = 4, 128, 16


@pytest.fixture
def runtime():
    rt = init_runtime(1, "cpu")
    yield rt
    shutdown()


def _model(layers=2, *, checkpointing=False):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512, num_hidden_layers=layers,
                      vocab_size=256, max_position_embeddings=512, attn_implementation="sdpa", tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    attach_logprob_method(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model, cfg


def _batch():
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    act = torch.zeros(B, T, dtype=torch.long)
    act[:, PROMPT:] = 1
    return ids, torch.ones(B, T, dtype=torch.long), act


def _micro_batch(strategy, state, *, sync: bool, chunk: int = 64):
    ids, mask, act = _batch()
    logp, _ = token_logprobs(state.model, ids, mask, with_entropy=True, chunk_tokens=chunk, positions_BT=act)
    strategy.backward(-(logp * act).sum() / act.sum(), state, sync_grads=sync)


def _prepared(runtime, **kw):
    strategy = get_strategy(StrategyConfig(param_dtype="bfloat16", compile="off"), runtime)
    model, cfg = _model(**kw)
    state = strategy.prepare_trainable(model, OptimConfig(lr=1e-3), lr=1e-3, total_steps=4)
    return strategy, state, cfg, sum(p.numel() for p in state.model.parameters())


def test_fsdp2_layout_is_what_the_strategy_keeps(runtime):
    strategy, state, cfg, n = _prepared(runtime)
    layout = memory_layout("fsdp2").trained(strategy.cfg, stored=n, trainable=n, world=1, offload=False)
    buffers = sum(b.numel() * b.element_size() for b in state.model.buffers())
    assert strategy.resident_bytes(state)["weights"] == layout.weights + buffers  # fp32 masters
    # a micro-batch without gradient sync: FSDP2 keeps every parameter's unsharded gradient in fp32
    _, net = allocation_peak(lambda: _micro_batch(strategy, state, sync=False))
    assert net == layout.grads_accumulating
    # the last micro-batch reduces them into the sharded fp32 gradients (one rank: the same size)
    _, net = allocation_peak(lambda: _micro_batch(strategy, state, sync=True))
    assert net + layout.grads_accumulating == layout.grads  # the accumulated ones freed, the shards kept
    strategy.optimizer_step(state)
    groups = sum(len(g["params"]) for g in state.optimizer.param_groups)  # one fp32 step counter each
    assert strategy.resident_bytes(state)["optimizer"] == layout.optimizer_device + 4 * groups


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp2_update_peak_within_the_plans_terms(runtime, checkpointing):
    """A micro-batch's forward and backward through the strategy (gradients already allocated, as
    after the first micro-batch): never above the plan's activations, the larger of the LM head's
    and a layer's backward, and the gathered layers; at most 15% below (the gathered root counts
    a separate LM head, tied here)."""
    strategy, state, cfg, n = _prepared(runtime, layers=4, checkpointing=checkpointing)
    _micro_batch(strategy, state, sync=True)  # gradients and lazily made buffers exist
    peak, _ = allocation_peak(lambda: _micro_batch(strategy, state, sync=True))
    shape, m = ModelShape.from_hf_config(cfg), B * (T - PROMPT)
    kw = dict(compiled=False, checkpointing=checkpointing)
    want = (train_activation_bytes(shape, B * T, response_tokens=m, **kw)
            + max(lm_head_train_bytes(shape, 64, compiled=False), layer_backward_bytes(shape, B * T, **kw))
            + memory_layout("fsdp2").working(strategy.cfg, layer_params=shape.layer_params(), root_params=shape.embedding_params(),
                                             backward=True))
    assert want >= peak >= want / 1.15


def test_checkpointed_layers_stay_eager():
    """A compiled layer's saved tensors escape HF's checkpoint (its peak with checkpointing equals
    its peak without, see the slow test below): checkpointed layers are not compiled."""
    plain, _ = _model()
    compile_layers(plain)
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in plain.model.layers)
    ckpt, _ = _model(checkpointing=True)
    assert checkpointed(ckpt)
    compile_layers(ckpt)
    assert not any(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in ckpt.model.layers)


@pytest.mark.slow
def test_compiled_layers_keep_their_saved_tensors_under_checkpointing(runtime):
    """Why checkpointed layers stay eager: on the trainer's path (FSDP2, bf16, a micro-batch after
    the first), layers compiled as compile_layers compiled them before it skipped checkpointed
    ones peak exactly as high under HF checkpointing as without it; eager, checkpointing saves."""
    def peak(*, compiled: bool, checkpointing: bool) -> int:
        torch._dynamo.reset()
        strategy = get_strategy(StrategyConfig(param_dtype="bfloat16", compile="off"), runtime)
        model, _ = _model(4, checkpointing=checkpointing)
        if compiled:
            for layer in model.model.layers:
                layer.forward = torch.compile(layer.forward, dynamic=True)
        state = strategy.prepare_trainable(model, OptimConfig(lr=1e-3), lr=1e-3, total_steps=4)
        _micro_batch(strategy, state, sync=True)  # compiles; gradients and lazily made buffers exist
        return allocation_peak(lambda: _micro_batch(strategy, state, sync=True))[0]

    compiled_ckpt = peak(compiled=True, checkpointing=True)
    assert compiled_ckpt == peak(compiled=True, checkpointing=False)
    assert peak(compiled=False, checkpointing=True) < 0.6 * compiled_ckpt
