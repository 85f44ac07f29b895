"""StreamedAdamW (``strategy.offload_optimizer`` with FSDP2): bit-for-bit torch AdamW over several
steps (weight decay, warmup + cosine LR, clipping, a skipped non-finite step, parameters split over
chunks), its state in host memory with only two staging chunks on the "device" during a step
(CPU accounting), and checkpoints through DCP that resume exactly, also from torch AdamW's."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.memory_accounting import LiveBytes
from tidal.distributed.runtime import init_runtime, shutdown
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.strategy import OptimConfig, StrategyConfig, get_strategy
from tidal.strategy.base import lr_lambda
from tidal.strategy.streamed_adamw import StreamedAdamW

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, warmup_steps=2, scheduler="cosine",
                    min_lr_ratio=0.1, max_grad_norm=0.5)


def _pair(chunk_bytes: int):
    """The same parameters under torch AdamW (foreach, as FSDP2 on CPU) and StreamedAdamW, two groups."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(37, 5), (100,), (3, 3, 3), (64, 9)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    out = []
    for cls in ("torch", "streamed"):
        ps = [torch.nn.Parameter(v.clone()) for v in values]
        groups = [{"params": [ps[0], ps[3]], "weight_decay": OPTIM.weight_decay}, {"params": [ps[1], ps[2]], "weight_decay": 0.0}]
        kw = dict(lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps)
        opt = torch.optim.AdamW(groups, foreach=True, **kw) if cls == "torch" else \
            StreamedAdamW(groups, device="cpu", chunk_bytes=chunk_bytes, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(OPTIM, total_steps=8))
        out.append((ps, opt, sched))
    return out


def _strategy_step(params, opt, sched, grads):
    """Strategy.optimizer_step's order: clip (global norm), skip when non-finite, zero grads, schedule."""
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm, foreach=True))
    if math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return norm


@pytest.mark.parametrize("chunk_bytes", [8 * 64, 8 * 1000, 1 << 20])  # parameters split over chunks / several per chunk / one chunk
def test_equals_torch_adamw_bit_for_bit(chunk_bytes):
    (pa, oa, sa), (pb, ob, sb) = _pair(chunk_bytes)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen) for p in pa]
        if step == 3:  # a non-finite gradient: the step is skipped on both, the schedule advances
            grads[1][0] = float("nan")
        na, nb = _strategy_step(pa, oa, sa, grads), _strategy_step(pb, ob, sb, grads)
        assert math.isfinite(na) == (step != 3) and (math.isnan(na) and math.isnan(nb) or na == nb)
        for x, y in zip(pa, pb):
            assert torch.equal(x, y), f"step {step}"
    da, db = oa.state_dict(), ob.state_dict()
    assert da["param_groups"][0]["lr"] == db["param_groups"][0]["lr"]
    for i in da["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(da["state"][i][key], db["state"][i][key]), (i, key)
    n = sum(p.numel() for p in pb)
    assert ob.host_bytes == 8 * n  # both fp32 moments, exactly


def test_state_stays_on_the_host_and_a_step_stages_two_chunks():
    """CPU accounting of what a step allocates outside the host buffer (what a GPU would hold): two
    staging chunks and the AdamW kernel's temporaries, never the state; torch AdamW's first step
    allocates the whole state."""
    chunk = 8 * 64  # the state is 14 chunks
    (pa, oa, _), (pb, ob, _) = _pair(chunk)
    n = sum(p.numel() for p in pa)
    for params, opt in ((pa, oa), (pb, ob)):
        for p in params:
            p.grad = torch.ones_like(p)
    ignore = [p.untyped_storage().data_ptr() for p in pa + pb] + [p.grad.untyped_storage().data_ptr() for p in pa + pb]
    with LiveBytes(ignore=ignore) as torch_mode:
        oa.step()
    assert torch_mode.current >= 8 * n  # the moments live on, on the "device"
    ob.step()  # the host buffer is made at the first step
    start = ob._host.tensor.data_ptr()
    raw = ob._host.tensor.untyped_storage()  # the buffer's whole allocation (its tensor is page aligned inside it)
    with LiveBytes(ignore=ignore, ignore_range=(raw.data_ptr(), raw.data_ptr() + raw.nbytes())) as mode:
        ob.step()
    assert mode.current == 0  # nothing stays on the "device" after the step
    assert ob.peak_staging_bytes == 2 * chunk
    assert mode.peak <= 2 * chunk + chunk // 2 + 256  # two stages + a temporary of one moment (foreach's sqrt) + step scalars
    assert mode.peak < torch_mode.current / 4
    for st in ob.state.values():  # the state's moments are views of the host buffer
        for key in ("exp_avg", "exp_avg_sq"):
            assert start <= st[key].data_ptr() < start + ob.host_bytes


def test_refuses_what_it_cannot_stream():
    with pytest.raises(ValueError, match="fp32"):
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        p.grad = torch.zeros_like(p)
        StreamedAdamW([p], device="cpu").step()
    p = torch.nn.Parameter(torch.zeros(4, 6).t())
    p.grad = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match="contiguous"):
        StreamedAdamW([p], device="cpu").step()


# ---- through the FSDP2 strategy, with DCP checkpoints --------------------------------------------------------
@pytest.fixture
def runtime():
    rt = init_runtime(1, "cpu")
    yield rt
    shutdown()


def _actor(strategy):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=97, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    attach_logprob_method(model)
    return strategy.prepare_trainable(model, OPTIM, lr=OPTIM.lr, total_steps=8)


def _train(strategy, state, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 97, (3, 11), generator=gen)
        am = torch.ones_like(ids)
        logp, _ = token_logprobs(state.model, ids, am)
        strategy.backward(-logp.mean(), state, sync_grads=True)
        strategy.optimizer_step(state)


def _params(state):
    return {n: p.full_tensor().clone() for n, p in state.model.named_parameters()}


def _strategy(runtime, offload: bool):
    return get_strategy(StrategyConfig(compile="off", param_dtype="float32", offload_optimizer=offload), runtime)


def test_fsdp2_streamed_optimizer_matches_adamw_and_resumes_from_dcp(runtime, tmp_path):
    plain, streamed = _strategy(runtime, False), _strategy(runtime, True)
    a, b = _actor(plain), _actor(streamed)
    assert isinstance(b.optimizer, StreamedAdamW) and not isinstance(a.optimizer, StreamedAdamW)
    _train(plain, a, 3, seed=1)
    _train(streamed, b, 3, seed=1)
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    # offload/reload move nothing: the state is on the host already
    streamed.reload_optimizer(b)
    streamed.offload_optimizer(b)
    assert b.optimizer.host_bytes == 8 * sum(p.numel() for p in b.model.parameters())

    # save the streamed run, load it into a fresh one, continue: the same as continuing without a break
    dcp.save({"actor": streamed.state_dict(b)}, checkpoint_id=str(tmp_path / "streamed"))
    dcp.save({"actor": plain.state_dict(a)}, checkpoint_id=str(tmp_path / "adamw"))
    _train(streamed, b, 2, seed=2)
    want = _params(b)
    for source in ("streamed", "adamw"):  # a torch AdamW checkpoint loads into the streamed optimizer too
        fresh_strategy = _strategy(runtime, True)
        fresh = _actor(fresh_strategy)
        states = {"actor": fresh_strategy.state_dict(fresh)}
        dcp.load(states, checkpoint_id=str(tmp_path / source))
        fresh_strategy.load_state_dict(fresh, states["actor"])
        assert fresh.scheduler.last_epoch == 3
        _train(fresh_strategy, fresh, 2, seed=2)
        got = _params(fresh)
        assert all(torch.equal(got[n], want[n]) for n in want), source


def test_dtensor_moments_are_the_host_buffer_not_a_copy_on_the_meshs_device(runtime, monkeypatch):
    """The state's DTensor moments wrap views of the host buffer. ``DTensor.from_local`` moves a
    local tensor to its mesh's device type (on a CUDA mesh: a stale device copy of the whole
    state, 2 x fp32 parameters, measured as 57 GiB at 7B on the H200): here it is made to copy
    as it would there, and the moments must still be the host buffer's."""
    real = DTensor.from_local

    def moving(local, *args, **kwargs):  # what from_local does on a mesh of another device type
        return real(local.clone(), *args, **kwargs)

    monkeypatch.setattr(DTensor, "from_local", staticmethod(moving))
    strategy = _strategy(runtime, True)
    state = _actor(strategy)
    _train(strategy, state, 1, seed=1)
    ob = state.optimizer
    start = ob._host.tensor.data_ptr()
    for p in state.model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            m = ob.state[p][key]
            assert isinstance(m, DTensor) and m.placements == p.placements and m.shape == p.shape
            assert start <= m._local_tensor.data_ptr() < start + ob.host_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streamed_equals_fused_adamw_and_pins_exactly():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in [(1000, 37), (4096,), (300, 300)]]
    pa = [torch.nn.Parameter(v.to(dev)) for v in values]
    pb = [torch.nn.Parameter(v.to(dev)) for v in values]
    oa = torch.optim.AdamW(pa, lr=1e-3, weight_decay=0.1, fused=True)
    ob = StreamedAdamW(pb, lr=1e-3, weight_decay=0.1, device=dev, chunk_bytes=8 * 20000)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(dev) for p in pa]
        for x, y, g in zip(pa, pb, grads):
            x.grad, y.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert ob._host.pinned  # registered with cudaHostRegister (torch's is_pinned() answers for its own allocator's blocks only)
    assert ob.host_bytes == 8 * sum(p.numel() for p in pb)
    assert ob.peak_staging_bytes == 2 * 8 * 20000
    for p in pb:
        assert not ob.state[p]["exp_avg"].is_cuda
