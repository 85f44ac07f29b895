"""Model FLOPs (hand-computed and against the model's own weights), MFU, and the update-phase split
(parts timed by the updater, transfers from the phase owner's events inside the train phase)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tidal.logging.timer import PhaseTimer
from tidal.logging.update_split import UpdateSplit, train_perf
from tidal.models.flops import FlopModel, measure_matmul_peak, mfu

QWEN05 = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, num_hidden_layers=24,
              vocab_size=151936)


def test_flops_of_a_qwen2_5_0_5b_shape_by_hand():
    fm = FlopModel.from_config(Qwen2Config(**QWEN05))
    # per layer: q 896x896, k and v 896x128, o 896x896, gate/up/down 3 x 896x4864
    assert fm.layer_params == 896 * 896 * 2 + 2 * 896 * 128 + 3 * 896 * 4864 == 14_909_440
    assert fm.head_params == 151936 * 896 and fm.attn_dim == 896 and fm.params == 24 * 14_909_440 + 151936 * 896
    lens = [300, 1000]
    dense = 6 * (24 * 14_909_440 * 1300 + 151936 * 896 * 1300)
    attention = 6 * 24 * 896 * (300**2 + 1000**2)
    assert fm.train_flops(lens) == pytest.approx(dense + attention)
    assert fm.train_flops(lens, head_tokens=0) == pytest.approx(dense - 6 * 151936 * 896 * 1300 + attention)
    assert fm.forward_flops(lens) == pytest.approx((dense + attention) / 3)


def test_sliding_window_layers_count_the_pairs_inside_their_window():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                           num_hidden_layers=3, vocab_size=101, sliding_window=100,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    fm = FlopModel.from_config(cfg)
    assert fm.windows == (100, None, 100)
    dense = FlopModel(num_layers=3, layer_params=fm.layer_params, head_params=fm.head_params, attn_dim=64).train_flops([300, 50])
    full_attention = 6 * 3 * 64 * (300**2 + 50**2)
    # a window layer: 100^2/2 + 200 x 100 pairs of the 300-token sequence (L^2/2 = 45000 when full); all of the 50-token one
    windowed = 6 * 64 * (300**2 + 50**2) + 2 * 12 * 64 * (100**2 / 2 + 200 * 100 + 50**2 / 2)
    assert fm.train_flops([300, 50]) == pytest.approx(dense - full_attention + windowed)


def test_layer_params_are_the_models_matmul_weights():
    cfg = Qwen2Config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80, num_hidden_layers=3,
                      vocab_size=101, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    fm = FlopModel.from_config(cfg)
    layer0 = sum(p.numel() for p in model.model.layers[0].parameters() if p.ndim == 2)
    assert fm.layer_params == layer0 and fm.head_params == model.lm_head.weight.numel()
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        FlopModel.from_config(Qwen2Config(num_experts=8))


def test_mfu_and_measured_peak():
    assert mfu(2e15, 4.0, 1e15) == 0.5 and mfu(1.0, 0.0, 1.0) == 0.0
    assert measure_matmul_peak(torch.device("cpu"), torch.float32, n=64, iters=2) > 0
    perf = train_perf(4e12, 2.0, 4e12)
    assert perf == {"perf/train_tflops": 2.0, "perf/mfu": 0.5}
    assert "perf/mfu" not in train_perf(4e12, 2.0, None)


def test_update_split_parts_and_transfers_inside_the_train_phase():
    timer = PhaseTimer(clock=lambda: 0.0, sync=lambda: None)
    split = UpdateSplit(torch.device("cpu"))
    timer.add_observer(split)
    timer.event("reload_model/reference:before")  # outside the train phase: not an update transfer
    timer.event("reload_model/reference:after")
    with timer.phase("train"):
        timer.event("reload_optimizer/actor:before")
        with split.part("forward"):
            sum(range(10000))
        timer.event("reload_optimizer/actor:after")
        with split.part("backward"):
            pass
    out = split.pop()
    assert set(out) == {"perf/forward_s", "perf/backward_s", "perf/optimizer_s", "perf/transfer_s"}
    assert out["perf/forward_s"] > 0 and out["perf/transfer_s"] >= out["perf/forward_s"] and out["perf/optimizer_s"] == 0
    assert split.pop()["perf/forward_s"] == 0.0
    with pytest.raises(ValueError, match="unknown update part"):
        with split.part("sideways"):
            pass
