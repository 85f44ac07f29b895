"""Host buffers of exactly the size asked for (``tidal.host_memory``): typed views, a module's
parameters copied out and back into one buffer reused across cycles (the engine's level-2 sleep),
parked models in one buffer per model. Pinning itself needs CUDA (the last tests)."""

import pytest
import torch

from tidal.host_memory import ParamHostCopy, PinnedBuffer
from tidal.strategy.parking import ModelParking


def test_pinned_buffer_views_are_bounded_and_typed():
    buf = PinnedBuffer(100, pin=False, zero=True)
    assert buf.nbytes == 100 and buf.tensor.numel() == 100 and buf.tensor.data_ptr() % 4096 == 0
    v = buf.view(8, (3, 4), torch.float32)
    v.fill_(2.0)
    assert buf.tensor[8:56].view(torch.float32).sum() == 24.0 and buf.tensor[:8].sum() == 0
    for offset, shape, dtype in [(92, (3,), torch.float32), (2, (2,), torch.float32), (-4, (1,), torch.float32)]:
        with pytest.raises(ValueError):
            buf.view(offset, shape, dtype)


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3, bias=False))


def test_param_host_copy_is_made_once_and_reused():
    model = _module()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    copy = ParamHostCopy(pin=False)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert copy.offload(model.named_parameters()) == nbytes
    assert copy.holds and all(p.numel() == 0 for p in model.parameters())
    buffer, ptr = copy.buffer, copy.buffer.tensor.data_ptr()
    assert buffer.nbytes == sum(-(-p.numel() * 4 // 64) * 64 for p in want.values())  # each 64-byte aligned, nothing more
    assert copy.restore(model.named_parameters(), torch.device("cpu")) == nbytes and not copy.holds
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        model[0].weight.add_(1.0)  # new values between sleeps (a weight sync) are what the next copy holds
    copy.offload(model.named_parameters())
    assert copy.buffer is buffer and copy.buffer.tensor.data_ptr() == ptr  # the same memory, no new allocation
    copy.restore(model.named_parameters(), torch.device("cpu"))
    assert torch.equal(model[0].weight, want["0.weight"] + 1.0)
    other = torch.nn.Linear(5, 8)
    with pytest.raises(ValueError, match="not the one"):
        copy.offload(other.named_parameters())


def test_parking_holds_one_buffer_per_model_of_exactly_its_bytes():
    model = _module()
    parking = ModelParking(torch.device("cpu"))
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert parking.host_bytes(model) == 0
    parking.park(model)
    assert parking.host_bytes(model) == sum(-(-n // 64) * 64 for n in storages.values())
    parking.unpark(model)
    assert parking.host_bytes(model) == sum(-(-n // 64) * 64 for n in storages.values())  # kept for the next park


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_buffers_are_pinned_and_the_engine_reuses_its_sleep_copy():
    buf = PinnedBuffer(3 << 20, pin=True)
    assert buf.pinned  # registered with cudaHostRegister (torch's is_pinned() answers for its own allocator's blocks only)
    from tests.engine.helpers import tiny_hf
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    hf = tiny_hf()
    engine = NativeEngine(hf.config, EngineConfig(kv_cache_max_tokens=256), device=torch.device("cuda"), dtype=torch.bfloat16)
    engine.load_weights(hf.state_dict().items())
    want = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.wake_up()
    engine.sleep(2)
    first = engine._host_weights.buffer
    assert first.pinned and first.nbytes >= sum(p.numel() * p.element_size() for p in want.values())
    for _ in range(2):
        engine.wake_up()
        engine.sleep(2)
        assert engine._host_weights.buffer is first
    engine.wake_up()
    assert all(torch.equal(p, want[n]) for n, p in engine.model.named_parameters())
