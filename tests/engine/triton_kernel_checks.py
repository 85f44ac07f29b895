"""Triton kernels against the torch reference ops, and the whole engine on the Triton backend.

Run by ``test_triton_kernels.py`` in a fresh process: without CUDA the kernels run in Triton's
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before anything imports Triton.
Direct use: ``python -m pytest tests/engine/triton_kernel_checks.py``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.engine.native.attention import AttnMetadata  # noqa: E402
from tidal.engine.native.kernels import get_ops  # noqa: E402

from tests.engine.helpers import PROMPTS, engine_for, hf_greedy, tiny_hf  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _interpreter_scalar_index(monkeypatch):
    """Triton 3.6's interpreter keeps scalars as 1-element arrays, which numpy >= 2.4 refuses to turn
    into a loop bound; index them explicitly (interpreter only)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


def ops():
    return get_ops("torch", DEVICE), get_ops("triton", DEVICE)


def test_norm_silu_rope_store(dtype):
    ref, tri = ops()
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    x, r, w = rnd(5, 96), rnd(5, 96), rnd(96)
    for res in (None, r):
        (ya, ra), (yb, rb) = tri.rms_norm(x, w, 1e-6, res), ref.rms_norm(x, w, 1e-6, res)
        assert rel(ya, yb) < TOL[dtype] and rel(ra, rb) < TOL[dtype]
    gu = rnd(5, 160)
    assert rel(tri.silu_mul(gu), ref.silu_mul(gu)) < TOL[dtype]
    T, HQ, HKV, D, page, nb = 6, 6, 2, 16, 4, 10
    q, k, v = rnd(T, (HQ + 2 * HKV) * D).split([HQ * D, HKV * D, HKV * D], -1)
    q, k, v = q.view(T, HQ, D), k.view(T, HKV, D), v.view(T, HKV, D)
    pos = torch.tensor([0, 3, 49, 7, 8, 20], device=DEVICE)
    cs = rnd(64, D)
    slots = torch.tensor([5, 0, 39, 12, 13, 22], device=DEVICE)
    caches = [torch.full((nb, page, HKV, D), float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    qa = tri.rope_store(q, k, v, pos, cs, caches[0], caches[1], slots)
    qb = ref.rope_store(q, k, v, pos, cs, caches[2], caches[3], slots)
    assert rel(qa, qb) < TOL[dtype]
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        a, b = a.view(-1, HKV, D), b.view(-1, HKV, D)
        assert rel(a[slots], b[slots]) < TOL[dtype]
        assert torch.isnan(a.view(-1)).sum() == (nb * page - T) * HKV * D  # nothing else written


def _paged_setup(dtype, g):
    B, HQ, HKV, D, page, nb = 3, 8, 2, 16, 4, 12
    kc = torch.randn(nb, page, HKV, D, generator=g).to(DEVICE, dtype)
    vc = torch.randn(nb, page, HKV, D, generator=g).to(DEVICE, dtype)
    bt = torch.stack([torch.randperm(nb, generator=g)[:6] for _ in range(B)]).int().to(DEVICE)
    return kc, vc, bt, HQ, D


def test_paged_decode_and_prefill_attention(dtype):
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot on the raw bits; checked on the GPU only")
    ref, tri = ops()
    g = torch.Generator().manual_seed(1)
    kc, vc, bt, HQ, D = _paged_setup(dtype, g)
    ctx = [7, 23, 1]
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    meta = AttnMetadata(is_prefill=False, slot_mapping_T=None, block_tables_BN=bt, context_lens_B=ctx_t,
                        max_context_len=max(ctx))
    qd = torch.randn(3, HQ, D, generator=g).to(DEVICE, dtype)
    want = ref.decode_attention(qd, kc, vc, meta, 0.25)
    assert rel(tri.decode_attention(qd, kc, vc, meta, 0.25), want) < TOL[dtype]
    # the context split over programs (flash-decoding), with slices of 16 tokens: 23 tokens over
    # 2 or 4 splits (one or two of them empty), 1 token with all but one split empty
    for splits in (1, 2, 4):
        assert rel(tri.decode_attention(qd, kc, vc, meta, 0.25, splits=splits, block_n=16), want) < TOL[dtype], splits
    ql = [3, 20, 1]  # sequence 0 and 1 have a cached prefix (4 and 3 tokens), sequence 2 has none
    meta = AttnMetadata(is_prefill=True, slot_mapping_T=None, block_tables_BN=bt, context_lens_B=ctx_t,
                        cu_seqlens_q_B1=torch.tensor([0, 3, 23, 24], dtype=torch.int32, device=DEVICE),
                        query_lens=ql, context_lens=ctx, max_query_len=max(ql), max_context_len=max(ctx))
    qp = torch.randn(24, HQ, D, generator=g).to(DEVICE, dtype)
    assert rel(tri.prefill_attention(qp, kc, vc, meta, 0.25), ref.prefill_attention(qp, kc, vc, meta, 0.25)) < TOL[dtype]
    # sliding windows: shorter than the prefix, than a key tile, and longer than every context
    for window in (1, 5, 17, 64):
        want = ref.prefill_attention(qp, kc, vc, meta, 0.25, window=window)
        assert rel(tri.prefill_attention(qp, kc, vc, meta, 0.25, window=window), want) < TOL[dtype], window
        assert window >= 23 or rel(ref.prefill_attention(qp, kc, vc, meta, 0.25), want) > 100 * TOL[dtype], window
    dmeta = AttnMetadata(is_prefill=False, slot_mapping_T=None, block_tables_BN=bt, context_lens_B=ctx_t,
                         max_context_len=max(ctx))
    for window in (1, 5, 17, 64):
        want = ref.decode_attention(qd, kc, vc, dmeta, 0.25, window=window)
        for splits in (1, 2, 4):
            got = tri.decode_attention(qd, kc, vc, dmeta, 0.25, window=window, splits=splits, block_n=16)
            assert rel(got, want) < TOL[dtype], (window, splits)


def test_window_attention_reads_only_each_querys_window(dtype):
    """The sliding-window pool's layout (issue 50 item 3): a window layer's block-table columns
    before a step's first window were given back, so here they point at a NaN block; both kernels
    (and the torch reference) must give the output of intact tables, i.e. never read them."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot on the raw bits; checked on the GPU only")
    ref, tri = ops()
    g = torch.Generator().manual_seed(2)
    kc, vc, bt, HQ, D = _paged_setup(dtype, g)
    page, poison = kc.shape[1], kc.shape[0]
    nan_block = torch.full((1, *kc.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    kcp, vcp = torch.cat([kc, nan_block]), torch.cat([vc, nan_block])
    ctx, ql = [7, 23, 1], [3, 20, 1]
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    qd = torch.randn(3, HQ, D, generator=g).to(DEVICE, dtype)
    qp = torch.randn(24, HQ, D, generator=g).to(DEVICE, dtype)
    cu = torch.tensor([0, 3, 23, 24], dtype=torch.int32, device=DEVICE)

    def given_back(first_pos: list[int]) -> torch.Tensor:
        out = bt.clone()
        for b, p in enumerate(first_pos):
            out[b, : p // page] = poison
        return out

    def dmeta(table):
        return AttnMetadata(is_prefill=False, slot_mapping_T=None, block_tables_BN=table, context_lens_B=ctx_t,
                            max_context_len=max(ctx))

    def pmeta(table):
        return AttnMetadata(is_prefill=True, slot_mapping_T=None, block_tables_BN=table, context_lens_B=ctx_t,
                            cu_seqlens_q_B1=cu, query_lens=ql, context_lens=ctx, max_query_len=max(ql),
                            max_context_len=max(ctx))

    for window in (1, 5, 8, 17):
        btp = given_back([max(0, c - window) for c in ctx])  # decode: the query at c - 1 reads from c - window
        assert window >= 23 or (btp == poison).any()
        want = ref.decode_attention(qd, kc, vc, dmeta(bt), 0.25, window=window)
        assert rel(ref.decode_attention(qd, kcp, vcp, dmeta(btp), 0.25, window=window), want) < TOL[dtype], window
        for splits in (1, 2, 4):
            got = tri.decode_attention(qd, kcp, vcp, dmeta(btp), 0.25, window=window, splits=splits, block_n=16)
            assert rel(got, want) < TOL[dtype], (window, splits)
        btp = given_back([max(0, c - q - window + 1) for c, q in zip(ctx, ql)])  # prefill: from the first query's window
        want = ref.prefill_attention(qp, kc, vc, pmeta(bt), 0.25, window=window)
        assert rel(ref.prefill_attention(qp, kcp, vcp, pmeta(btp), 0.25, window=window), want) < TOL[dtype], window
        assert rel(tri.prefill_attention(qp, kcp, vcp, pmeta(btp), 0.25, window=window), want) < TOL[dtype], window


def test_engine_with_a_window_pool_on_triton_equals_hf_greedy():
    """Gemma 3 (window 8 beside full layers, blocks of 4): the window layers' own pool, given back
    as the window moves and reused by the other sequences, on the Triton kernels (and with CUDA
    graphs on a GPU, whose padded rows write both pools' scratch blocks)."""
    from tests.engine.test_families import tiny

    hf = tiny("gemma3").to(DEVICE)
    engine = engine_for(hf, device=DEVICE.type, kernel_backend="triton", max_num_batched_tokens=16)
    assert engine.runner.window == 8
    prompts = PROMPTS[:3]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    for p, c in zip(prompts, out):
        assert c.token_ids == hf_greedy(hf, p, 20)
    assert engine.window_blocks.num_free_blocks == engine.window_blocks.num_blocks


def test_engine_on_triton_kernels_equals_hf_greedy():
    hf = tiny_hf("qwen2").to(DEVICE)
    engine = engine_for(hf, device=DEVICE.type, kernel_backend="triton", max_num_batched_tokens=16)
    prompts = PROMPTS[:3]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))
    for p, c in zip(prompts, out):
        assert c.token_ids == hf_greedy(hf, p, 5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("top_k", [0, 5], ids=["sample-in-graph", "sample-after-graph"])
def test_engine_cuda_graphs_sample_like_eager(top_k):
    # decode graphs (with the logits and the draw inside when no top-k) give the eager engine's
    # tokens for the same seed: rows stop at different steps, so later batches are padded buckets
    hf = tiny_hf("qwen2").to(DEVICE)
    stops = tuple(range(0, hf.config.vocab_size, 6))  # about one token in six stops a row
    params = SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=12, n=3, seed=5, stop_token_ids=stops)
    eager, graphs = (engine_for(hf, device="cuda", kernel_backend="triton", cuda_graphs=g).generate(PROMPTS, params)
                     for g in (False, True))
    assert len({len(c.token_ids) for c in eager}) > 1  # the batch shrinks
    for a, b in zip(eager, graphs):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_decode_graphs_survive_level_1_sleep_at_a_fixed_kv_address():
    # the KV cache's memory goes back to the driver during sleep(1) and returns at the same addresses,
    # sized from the memory free at each wake-up, so the captured graphs are replayed again, not
    # re-captured; sleep(2) moves the weights: re-capture
    from tidal.engine.native import fixed_memory

    if not fixed_memory.supported(DEVICE):
        pytest.skip("the driver has no virtual memory management")
    hf = tiny_hf("qwen2").to(DEVICE)
    engine = engine_for(hf, device="cuda", kernel_backend="triton", kv_cache_memory_fraction=0.05)
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, n=2, seed=7)
    first = [[c.token_ids for c in engine.generate(PROMPTS, p)] for p in (greedy, sampled)]
    assert first[0] == [hf_greedy(hf, p, 6) for p in PROMPTS]
    runner = engine.runner
    graphs, kv_bytes = dict(runner.graphs.graphs), engine.memory_report()["kv_cache"]
    ptrs = [t.data_ptr() for t in runner.kv_layers]
    assert len({t for _, t in graphs}) == 2  # a graph without sampling (greedy) and one with
    sizes = {runner.num_blocks}
    for level, hog_gib in ((1, 8), (1, 0), (2, 4)):
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info(DEVICE)[0]
        assert engine.sleep(level) >= kv_bytes
        assert torch.cuda.mem_get_info(DEVICE)[0] - free_awake >= kv_bytes  # back with the driver
        hog = torch.empty(hog_gib << 30, dtype=torch.uint8, device=DEVICE)  # the trainer holds memory meanwhile
        engine.wake_up()
        kv_bytes = engine.memory_report()["kv_cache"]
        sizes.add(runner.num_blocks)
        assert [t.data_ptr() for t in runner.kv_layers] == ptrs
        kept = all(runner.graphs.graphs.get(k) is g for k, g in graphs.items())
        assert kept == (level == 1)
        again = [[c.token_ids for c in engine.generate(PROMPTS, p)] for p in (greedy, sampled)]
        assert again == first
        graphs = dict(runner.graphs.graphs)
        del hog
    assert len(sizes) > 1  # the cache followed the free memory


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_decode_batches_above_the_graph_limit_run_eagerly_with_the_same_tokens():
    hf = tiny_hf("qwen2").to(DEVICE)
    params = SamplingParams(temperature=0, max_new_tokens=5, n=6, ignore_eos=True)
    prompts = PROMPTS * 3  # 72 rows decode together
    small = engine_for(hf, device="cuda", kernel_backend="triton", cuda_graph_max_batch=16)
    big = engine_for(hf, device="cuda", kernel_backend="triton")
    assert small.runner.graphs.max_bs == 16 and big.runner.graphs.max_bs == 512
    a, b = small.generate(prompts, params), big.generate(prompts, params)
    assert not any(k[0] > 16 for k in small.runner.graphs.graphs)  # no graph was captured above the limit
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def _u(rows: int, seed: int) -> torch.Tensor:
    """Keyed uniforms (requests 0..rows-1, index 5) on the device, as the engine draws them."""
    import numpy as np

    from tidal.engine.sampler import keyed_uniforms

    return torch.from_numpy(keyed_uniforms(np.full(rows, seed), np.arange(rows), np.full(rows, 5))).to(DEVICE)


def test_fused_sampler_draws_the_torch_paths_token_for_the_same_uniform():
    # the kernel mirrors inverse_cdf: the same uniform, the same token (a graph's buffer of uniforms
    # is read the same way), alone or in a batch
    from tidal.engine.native.kernels.triton_sampling import fused_sample
    from tidal.engine.sampler import inverse_cdf, process_logits

    g = torch.Generator().manual_seed(3)
    for logits in ((torch.randn(8, 300, generator=g) * 2).to(DEVICE), (torch.randn(4, 20000, generator=g) * 2).to(DEVICE)):
        u = _u(len(logits), 4)
        tok, logp = fused_sample(logits, 0.9, u)
        want = inverse_cdf(process_logits(logits, 0.9, 0, 1.0).exp(), u)
        assert torch.equal(tok, want)
        alone = torch.cat([fused_sample(logits[b : b + 1], 0.9, u[b : b + 1])[0] for b in range(len(logits))])
        assert torch.equal(alone, tok)


def test_fused_sampler_logprobs_and_distribution():
    from tidal.engine.native.kernels.triton_sampling import fused_sample
    from tidal.engine.sampler import process_logits

    g = torch.Generator().manual_seed(2)
    for logits in ((torch.randn(6, 300, generator=g) * 3).to(DEVICE),  # one program per row
                   (torch.randn(3, 20000, generator=g) * 3).to(DEVICE).bfloat16()):  # 16 chunks per row
        _check_fused_rows(fused_sample, process_logits, logits)
    # 800 draws from one 5-way distribution: frequencies match softmax(logits / T) (3.5 sigma)
    row = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]], device=DEVICE).expand(800, 5)
    tok, _ = fused_sample(row, 0.8, _u(800, 1))
    freq = torch.bincount(tok.cpu(), minlength=5).double() / 800
    assert torch.allclose(freq, torch.softmax(row[0].cpu().double() / 0.8, -1), atol=0.06)
    # a wide vocabulary (16 chunks), mass on four neighbours and on two tokens in other chunks (the
    # last one in the last chunk): their frequencies match too (the chunk, then the token in it)
    wide = torch.full((1, 20000), -30.0)
    hot = torch.tensor([0, 1, 2, 3, 5000, 19999])
    wide[0, hot] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.5, 0.5])
    rows = 2000 if DEVICE.type == "cuda" else 200  # the interpreter takes ~0.4 s a row
    tok, _ = fused_sample(wide.to(DEVICE).expand(rows, 20000), 1.0, _u(rows, 2))
    freq = torch.bincount(tok.cpu(), minlength=20000)[hot].double() / rows
    assert torch.allclose(freq, torch.softmax(wide[0, hot].double(), -1), atol=3.5 * (0.25 / rows) ** 0.5), freq


def _check_fused_rows(fused_sample, process_logits, logits):
    for temperature in (0.0, 0.7, 1.0):
        tok, logp = fused_sample(logits, temperature, _u(len(logits), 0) if temperature else None)
        ref = process_logits(logits, temperature, 0, 1.0)
        assert torch.allclose(logp, ref.gather(-1, tok[:, None]).squeeze(-1), atol=1e-5)
        if temperature == 0:
            assert torch.equal(tok, logits.argmax(-1))
        else:  # the same uniforms give the same draws
            assert torch.equal(tok, fused_sample(logits, temperature, _u(len(logits), 0))[0])
