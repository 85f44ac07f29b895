"""Exact mode's ops (tidal/exact.py) on this machine's kernels: each is batch-invariant (a row's
bits do not depend on the other rows, their number, its place, padding), at one and two threads,
fp32 and bf16, and computes what it replaces (against torch, to rounding). And the config checks of
``numerics.exact`` (tidal/numerics.py): each refused combination names its key."""

import pytest
import torch
import torch.nn.functional as F

from tidal import exact
from tidal.config import load_config
from tidal.config_base import ConfigError

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_rows_do_not_depend_on_the_batch(dtype, threads):
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(352, 128, generator=gen).to(dtype)
    b = torch.randn(352, generator=gen).to(dtype)
    X = torch.randn(70, 128, generator=gen).to(dtype)
    ref = exact.linear(X, W, b)
    for start, m in ((0, 1), (5, 1), (3, 2), (9, 7), (0, 16), (17, 33), (1, 69)):
        assert torch.equal(exact.linear(X[start:start + m], W, b), ref[start:start + m]), (start, m)
    perm = torch.randperm(70, generator=gen)
    assert torch.equal(exact.linear(X[perm], W, b), ref[perm])
    # an output column does not depend on the others (fused q/k/v or gate/up == separate projections)
    assert torch.equal(exact.linear(X, W[:96], b[:96]), ref[:, :96])
    torch.testing.assert_close(ref, F.linear(X, W, b), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    assert exact.linear(X[:0], W, b).shape == (0, 352)
    assert exact.linear(X.view(7, 10, 128), W, b).shape == (7, 10, 352)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["silu", "sigmoid", "tanh", "softplus", "gelu_tanh"])
def test_activations_are_position_invariant_and_correct(name, dtype, threads):
    x = (torch.randn(4099, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    fn = getattr(exact, name)
    full = fn(x)
    one_by_one = torch.cat([fn(x[i:i + 1]) for i in range(300)])  # the scalar tail of a kernel, if any
    assert torch.equal(full[:300], one_by_one)
    assert torch.equal(fn(x[7:2000]), full[7:2000])
    ref = {"silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "softplus": F.softplus,
           "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[name](x.float())
    torch.testing.assert_close(full.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 2e-6, atol=1e-6)


def _reference_attention(q, k, v, qpos, klen, scale, window):
    """Per query: plain softmax attention over its visible keys (float64)."""
    G, Q, H, D = q.shape
    out = torch.zeros(G, Q, H, D, dtype=torch.float64)
    rep = H // k.shape[2]
    for g in range(G):
        for i in range(Q):
            p = int(qpos[g, i])
            lo = 0 if window is None else max(0, p - window + 1)
            hi = min(p + 1, int(klen[g]))
            kk = k[g, lo:hi].double().repeat_interleave(rep, 1)
            vv = v[g, lo:hi].double().repeat_interleave(rep, 1)
            w = torch.softmax(torch.einsum("hd,jhd->hj", q[g, i].double(), kk) * scale, -1)
            out[g, i] = torch.einsum("hj,jhd->hd", w, vv)
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_is_invariant_across_prefill_decode_and_padding(dtype, window, threads):
    gen = torch.Generator().manual_seed(2)
    L, H, K, D = 150, 4, 2, 16  # crosses two KV blocks
    q = torch.randn(1, L, H, D, generator=gen).to(dtype)
    k = torch.randn(1, L, K, D, generator=gen).to(dtype)
    v = torch.randn(1, L, K, D, generator=gen).to(dtype)
    pos = torch.arange(L)[None]
    full = exact.attention(q, k, v, pos, torch.tensor([L]), 0.25, window)  # a packed training row / one prefill
    ref = _reference_attention(q, k, v, pos, torch.tensor([L]), 0.25, window)
    torch.testing.assert_close(full.double(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    # decode: query t alone over keys 0..t (its own key count), batched with other sequences' decodes
    ts = [0, 1, 63, 64, 65, 100, 149]
    qd = torch.cat([q[:, t] for t in ts])[:, None]
    kd = torch.zeros(len(ts), L + 7, K, D, dtype=dtype)  # padded beyond every context: never read
    vd = torch.zeros_like(kd)
    for i, t in enumerate(ts):
        kd[i, : t + 1], vd[i, : t + 1] = k[0, : t + 1], v[0, : t + 1]
    ctx = torch.tensor(ts) + 1
    dec = exact.attention(qd, kd, vd, (ctx - 1)[:, None], ctx, 0.25, window)
    assert torch.equal(dec[:, 0], full[0, ts])
    # chunked prefill: queries 70..99 over keys 0..99
    chunk = exact.attention(q[:, 70:100], k[:, :100], v[:, :100], pos[:, 70:100], torch.tensor([100]), 0.25, window)
    assert torch.equal(chunk, full[:, 70:100])


def test_mode_swaps_and_refuses_sdpa():
    x = torch.randn(3, 8)
    W = torch.randn(5, 8)
    assert not exact.active()
    with exact.exact_numerics():
        assert exact.active()
        assert torch.equal(F.linear(x, W), exact.linear(x, W))  # routed through the tile, once (no recursion)
        assert torch.equal(F.silu(x), exact.silu(x))
        with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
            F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
        with pytest.raises(NotImplementedError, match="tanh GELU"):
            F.gelu(x)
    assert not exact.active()
    with exact.exact_numerics(False):
        assert not exact.active()


EXACT = ["numerics.exact=true"]


@pytest.mark.parametrize("override, key", [
    ("engine.backend=hf engine.kv_cache_max_tokens=0", "engine.backend"),
    ("engine.tp_size=2", "engine.tp_size"),
    ("engine.speculative=on", "engine.speculative"),
    ("engine.kernel_backend=torch", "engine.kernel_backend"),
    ("model.lora.rank=8", "model.lora.rank"),
    ("engine.dtype=bfloat16", "engine.dtype"),
    ("task.architecture=olmo3", "task.architecture"),
])
def test_exact_refuses_what_it_cannot_make_bitwise(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", EXACT + override.split())
    assert err.value.key == key and "numerics.exact" in str(err.value)


def test_exact_config_default_off_and_accepted():
    assert load_config("quickstart").numerics.exact is False
    assert load_config("quickstart", EXACT).numerics.exact is True
    assert load_config("quickstart", EXACT + ["engine.dtype=bfloat16", "strategy.param_dtype=bfloat16"]).numerics.exact


@pytest.mark.parametrize("model_type, ok", [("qwen3", True), ("gemma3_text", True), ("llama", True), ("qwen2", True),
                                            ("qwen3_5_text", True), ("qwen3_moe", True), ("olmoe", True),
                                            ("qwen3_5_moe_text", True), ("olmo3", False), ("qwen2_vl", False)])
def test_exact_model_families(model_type, ok):
    from transformers import AutoConfig

    from tidal.numerics import check_exact_model

    cfg = load_config("quickstart", EXACT)
    hf = AutoConfig.for_model(model_type)
    if model_type == "gemma3_text":
        hf.final_logit_softcapping = None
    if ok:
        check_exact_model(cfg, hf)
    else:
        with pytest.raises(ConfigError, match="does not cover"):
            check_exact_model(cfg, hf)
    check_exact_model(load_config("quickstart"), hf)  # off: nothing to check


def test_exact_refuses_a_soft_capped_head():
    from transformers import AutoConfig

    from tidal.numerics import check_exact_model

    hf = AutoConfig.for_model("gemma3_text", final_logit_softcapping=30.0)
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        check_exact_model(load_config("quickstart", EXACT), hf)


def test_topk_breaks_ties_by_the_lowest_index():
    p = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25, 0.0]])
    values, idx = exact.topk(p, 3)
    assert idx.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert torch.equal(values, p.gather(-1, idx))
    with exact.exact_numerics():
        assert torch.topk(p, 2).indices.tolist() == [[1, 3], [0, 1]] and p.topk(1)[1].tolist() == [[1], [0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_index_add_adds_repeats_in_order_rounding_each(dtype):
    """One call with a token's k rows equals k calls in that order (transformers' experts loop)."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(12, 8, generator=gen).to(dtype)
    index = torch.tensor([0, 2, 1, 0, 2, 0, 3, 1, 0, 2, 3, 3])
    one = torch.zeros(4, 8, dtype=dtype)
    exact.index_add_(one, 0, index, src)
    sequential = torch.zeros(4, 8, dtype=dtype)
    for i in range(12):
        sequential.index_add_(0, index[i:i + 1], src[i:i + 1])
    assert torch.equal(one, sequential)


@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_groups_do_not_change_a_sequence(window):
    """Packed sequences of different lengths attended in groups (padded to the group's longest)
    give each sequence the bits it gets alone; padding rows that see no key stay out of the
    gradient (no 0/0)."""
    gen = torch.Generator().manual_seed(4)
    lens = [5, 17, 1, 9]
    cu = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32)
    q, k, v = (torch.randn(32, h, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    out = exact.varlen_attention(q, k, v, cu, 0.3, window)
    start = 0
    for n in lens:
        alone = exact.varlen_attention(q[start:start + n], k[start:start + n], v[start:start + n],
                                       torch.tensor([0, n], dtype=torch.int32), 0.3, window)
        assert torch.equal(out[start:start + n], alone)
        start += n
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
