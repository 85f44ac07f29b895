"""strategy.compile: FSDP2 compiles each decoder layer's forward in place (same names, same
logprobs and gradients as eager, one graph for every layer and every micro-batch shape)."""

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
