"""GPU checks of packed forwards (skipped without CUDA): PyTorch's flash varlen kernel equals SDPA run
on each sequence alone (bf16, forward and backward, GQA and MHA), a bf16 model's packed logprobs
and gradients agree with its padded ones, and compiled layers plus the LM-head kernels never
recompile on new packed shapes.

Run on a GPU machine: ``python -m pytest -q tests/unit/test_packed_cuda.py``.

Tolerances, bf16: the kernels agree to atol 2e-2 on unit-scale values (bf16 epsilon 7.8e-3, summed
over up to 700 keys); a bf16 model's packed logprobs differ from its padded ones by a mean below 2e-2
nats (different attention kernels round differently in every layer) and its gradients point the
same way (cosine > 0.99).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")


def _packed_qkv(lens, heads, kv_heads, D, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    N = sum(lens)
    q, k, v = (torch.randn(N, h, D, generator=g, device=DEV, dtype=torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    return q, k, v, cu


@pytest.mark.parametrize("heads, kv_heads, D", [(14, 2, 64), (16, 16, 128), (12, 2, 128)])
def test_flash_varlen_equals_sdpa_per_sequence_bf16(heads, kv_heads, D):
    from tidal.models.varlen import uses_flash, varlen_attention

    lens = [1, 700, 33, 256, 5, 480]
    q, k, v, cu = _packed_qkv(lens, heads, kv_heads, D)
    assert uses_flash(q)
    out = varlen_attention(q, k, v, cu, max(lens), causal=True)
    g_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g_out)
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        qs, ks, vs = (t.detach()[a:b].transpose(0, 1).requires_grad_() for t in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(0, 1)
        wq, wk, wv = torch.autograd.grad(want, (qs, ks, vs), g_out[a:b])
        torch.testing.assert_close(out[a:b], want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dq[a:b], wq.transpose(0, 1), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dk[a:b], wk.transpose(0, 1), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(dv[a:b], wv.transpose(0, 1), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [1, 64, 300])
def test_flash_varlen_sliding_window_equals_the_reference(window):
    """The flash kernel's window (``window_size=(W - 1, 0)``) is HF's ``sliding_window`` W: the same
    output as the reference mask ``i - j < W`` inside each sequence."""
    from tidal.models.varlen import reference_varlen_attention, varlen_attention

    lens = [1, 700, 33, 256, 5, 480]
    q, k, v, cu = _packed_qkv(lens, 8, 2, 64)
    with torch.no_grad():
        got = varlen_attention(q, k, v, cu, max(lens), window=window)
        want = reference_varlen_attention(q.float(), k.float(), v.float(), cu, window=window)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def _model(seed=0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tidal.models.logprobs import attach_logprob_method

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=1000, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg).to(DEV, torch.bfloat16)
    attach_logprob_method(model)
    return model


def _batch(lengths, prompt=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(1, 1000, (B, T), generator=g)
    am = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    act = (am.bool() & (torch.arange(T)[None] >= prompt)).float()
    return ids * am, am, act


def test_bf16_model_packed_logprobs_and_gradients_agree_with_padded():
    from tidal.models.logprobs import token_logprobs
    from tidal.models.packing import PackedBatch
    from tidal.models.varlen import enable_packed_attention

    plain = _model()
    packed = copy.deepcopy(plain)
    enable_packed_attention(packed)
    ids, am, act = _batch([40, 600, 130, 17, 333])
    pb = PackedBatch.build(ids, am, targets_BT=act).to(DEV)
    ids, am, act = ids.to(DEV), am.to(DEV), act.to(DEV)
    grads = []
    for model, kw in ((plain, dict(positions_BT=act)), (packed, dict(packed=pb))):
        logp, ent = token_logprobs(model, ids, am, with_entropy=True, **kw)
        (-(logp * act).sum() / act.sum()).backward()
        grads.append((logp.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    (want, g_want), (got, g_got) = grads
    diff = ((got - want).abs() * act).sum() / act.sum()
    assert diff < 2e-2, float(diff)
    assert float(F.cosine_similarity(g_got, g_want, dim=0)) > 0.99


@pytest.mark.slow
def test_compiled_packed_training_never_recompiles_on_cuda():
    """FSDP2 with ``strategy.compile=on`` (Inductor) on bf16: after the first iteration (grad and
    no-grad forwards, entropies), new packed lengths, sequence counts, longest sequences and an
    LM-head chunk of one row compile nothing, and nothing breaks the graphs."""
    from tidal.distributed.runtime import init_runtime, shutdown
    from tidal.logging.compile import CompileMonitor
    from tidal.models.logprobs import token_logprobs
    from tidal.models.packing import PackedBatch
    from tidal.models.varlen import enable_packed_attention
    from tidal.strategy import OptimConfig, StrategyConfig, get_strategy

    from torch._dynamo.utils import counters

    rt = init_runtime(1, "cuda")
    try:
        torch._dynamo.reset()
        counters.clear()
        strategy = get_strategy(StrategyConfig(compile="on"), rt)
        model = _model().float()
        enable_packed_attention(model)
        state = strategy.prepare_trainable(model, OptimConfig(lr=1e-5), lr=1e-5, total_steps=10)
        messages = []
        with CompileMonitor(messages.append) as mon:
            for step, lengths in enumerate([[300, 50, 1000], [17, 17], [900], [64] * 20, [33, 700, 2, 400], [30]]):
                ids, am, act = _batch(lengths, prompt=1, seed=step)
                pb = PackedBatch.build(ids, am, targets_BT=act).to(DEV)
                K = int(pb.targets_K.numel())
                chunk = K - 1 if step == 3 else 512  # step 3: a last chunk of one row
                ids, am = ids.to(DEV), am.to(DEV)
                with torch.no_grad():
                    token_logprobs(state.model, ids, am, packed=pb, chunk_tokens=chunk)
                logp, ent = token_logprobs(state.model, ids, am, packed=pb, with_entropy=True, chunk_tokens=chunk)
                strategy.backward(-(logp.sum() + 0.01 * ent.sum()) / K, state, sync_grads=True)
                strategy.optimizer_step(state)
                m = mon.pop()
        assert m["compile/recompiles"] == 0, messages
        assert not counters["graph_break"], dict(counters["graph_break"])  # the layers and the flash kernel compile whole
    finally:
        shutdown()
