"""Parking frozen models (``tidal.strategy.parking``): device memory freed in place, values back
bit for bit, one host copy per storage made once and again only after an in-place write. On CPU the
"device" storages are CPU storages (the mechanism is the same; pinning needs CUDA)."""

import pytest
import torch

from tidal.distributed.runtime import init_runtime, shutdown
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.strategy import StrategyConfig, get_strategy
from tidal.strategy.parking import ModelParking


def _storage_bytes(model) -> list[int]:
    return [(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in model.parameters()]


def test_park_frees_in_place_and_copies_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 4))
    model[1].weight = torch.nn.Parameter(model[0].weight.t())  # a view sharing a storage: one copy for both
    model.register_buffer("table", torch.arange(5.0))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    tensors = {n: t for n, t in model.state_dict().items()}
    parking = ModelParking(torch.device("cpu"))
    nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}.values())

    assert parking.park(model) == nbytes
    assert parking.is_parked(model) and set(_storage_bytes(model)) == {0}
    assert parking.copies_to_host == 4  # 0.weight (shared with 1.weight), 0.bias, 1.bias, table
    assert parking.park(model) == 0  # already parked
    assert parking.unpark(model) == nbytes and not parking.is_parked(model)
    for n, t in model.state_dict().items():
        assert t is tensors[n] or torch.equal(t, tensors[n])  # the same objects, holding the same values
        assert torch.equal(t, before[n]), n

    parking.park(model)  # frozen: nothing copied again
    assert parking.copies_to_host == 4
    parking.unpark(model)
    with torch.no_grad():
        model[0].bias.add_(1.0)  # written in place: that storage alone is copied at the next park
    parking.park(model)
    assert parking.copies_to_host == 5
    parking.unpark(model)
    assert torch.equal(model[0].bias, before["0.bias"] + 1.0)
    assert torch.equal(model[1].weight, before["1.weight"])


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_parked_fsdp2_model_gives_the_same_logprobs(device):
    """Through the strategy on CUDA (pinned host copies), through ModelParking on CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    runtime = init_runtime(1, device)
    try:
        torch.manual_seed(0)
        cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=64, vocab_size=97, tie_word_embeddings=True)
        hf = AutoModelForCausalLM.from_config(cfg)
        attach_logprob_method(hf)
        strategy = get_strategy(StrategyConfig(param_dtype="float32", compile="off"), runtime)
        reference = strategy.prepare_frozen(hf, offload=False)
        ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
        am = torch.ones(2, 9, dtype=torch.long, device=device)
        with torch.no_grad():
            want, _ = token_logprobs(reference, ids, am)
        parking = ModelParking(torch.device("cpu")) if device == "cpu" else strategy._parking
        for _ in range(2):
            if device == "cpu":
                parking.park(reference)
            else:
                strategy.offload_model(reference)
            assert set(_storage_bytes(reference)) == {0}
            if device == "cpu":
                parking.unpark(reference)
            else:
                strategy.reload_model(reference)
            with torch.no_grad():
                got, _ = token_logprobs(reference, ids, am)
            assert torch.equal(got, want)
        storages = {t.untyped_storage().data_ptr() for t in [p.to_local() for p in reference.parameters()] + list(reference.buffers())}
        assert parking.copies_to_host == len(storages)  # once each, over both parks
    finally:
        shutdown()
