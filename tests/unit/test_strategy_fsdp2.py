"""FSDP2 strategy: ``strategy.compile`` compiles each decoder layer's forward in place (same names,
same logprobs and gradients as eager, one graph for every layer and every micro-batch shape); frozen
models are stored in their compute dtype."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tidal.config_base import ConfigError
from tidal.distributed.runtime import init_runtime, shutdown
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy


@pytest.fixture
def runtime():
    rt = init_runtime(1, "cpu")
    yield rt
    shutdown()


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=97, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    attach_logprob_method(model)
    return model


def test_compile_setting_and_config_errors(runtime):
    assert not get_strategy(StrategyConfig(), runtime).compiles  # auto: off on CPU
    assert get_strategy(StrategyConfig(compile="on"), runtime).compiles
    assert not get_strategy(StrategyConfig(compile="off"), runtime).compiles
    StrategyConfig(backend="deepspeed", compile="off")
    with pytest.raises(ConfigError) as e:
        StrategyConfig(backend="deepspeed", compile="on")
    assert e.value.key == "compile"


@pytest.mark.slow
def test_compiled_layers_match_eager(runtime):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    optim = OptimConfig(lr=1e-3)
    eager = get_strategy(StrategyConfig(compile="off"), runtime).prepare_trainable(_tiny(), optim, lr=1e-3, total_steps=1)
    compiled = get_strategy(StrategyConfig(compile="on"), runtime).prepare_trainable(_tiny(), optim, lr=1e-3, total_steps=1)
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in eager.model.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    for B, T in [(3, 10), (5, 17), (2, 9)]:  # micro-batches of different shapes, one with padding
        ids = torch.randint(0, 97, (B, T), generator=gen)
        am = torch.ones(B, T, dtype=torch.long)
        am[0, -3:] = 0
        outs = []
        for state in (eager, compiled):
            logp, ent = token_logprobs(state.model, ids, am, with_entropy=True)
            (logp * am).sum().backward()
            outs.append((logp.detach(), ent.detach()))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
    grads = {n: p.grad.full_tensor() for n, p in eager.model.named_parameters()}
    for n, p in compiled.model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads[n], atol=1e-5, rtol=1e-4, msg=n)
    # one graph serves all three layers and all shapes (dynamic), and nothing fell back to eager
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_frozen_model_is_stored_in_compute_dtype_and_matches_the_actor(runtime, param_dtype):
    """A frozen model (reference) keeps no fp32 master weights: parameters in the compute dtype,
    floating buffers (RoPE frequencies) in fp32, and its logprobs equal, bit for bit, those of the
    same weights prepared as a trained actor (fp32 master, computing in param_dtype)."""
    strategy = get_strategy(StrategyConfig(param_dtype=param_dtype, compile="off"), runtime)
    actor = strategy.prepare_trainable(_tiny(), OptimConfig(), lr=1e-6, total_steps=1).model
    reference = strategy.prepare_frozen(_tiny(), offload=True)
    dtype = getattr(torch, param_dtype)
    assert {p.dtype for p in reference.parameters()} == {dtype}
    assert {p.dtype for p in actor.parameters()} == {torch.float32}
    buffers = [b for b in reference.buffers() if b.is_floating_point()]
    assert buffers and {b.dtype for b in buffers} == {torch.float32}
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (3, 12), generator=gen)
    am = torch.ones(3, 12, dtype=torch.long)
    am[1, -4:] = 0
    strategy.reload_model(reference)
    with torch.no_grad():
        ref_logp, _ = token_logprobs(reference, ids, am)
        actor_logp, _ = token_logprobs(actor, ids, am)
    assert torch.equal(ref_logp, actor_logp)
