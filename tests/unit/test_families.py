"""The model-family registry (tidal/families): lookup by model_type, the window's semantics against
HF's mask, and the KV/state bytes, hand-computed."""

import subprocess
import sys

import pytest

from tidal import families
from tidal.config_base import ConfigError
from tidal.families import LayerCache

QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 3, "intermediate_size": 96, "vocab_size": 128}


def test_today_families_are_registered_and_native():
    assert {f.name for f in families.families()} >= {"qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3", "llama"}
    assert set(families.native_model_types()) >= {"qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3", "llama"}
    for f in families.families():
        assert f.name in f.model_types or f.model_types, f


def test_family_of_reads_config_objects_dicts_and_text_towers():
    from transformers import Qwen2Config, Qwen2VLConfig

    assert families.family_of(QWEN2).name == "qwen2"
    assert families.family_of(Qwen2Config(**{k: v for k, v in QWEN2.items() if k != "model_type"})).name == "qwen2"
    assert families.family_of(Qwen2VLConfig()).name == "qwen2_vl"
    vl = {"model_type": "qwen2_vl", "text_config": {**QWEN2, "model_type": "qwen2_vl_text"}}
    assert families.family_of(vl).text_prefix == "model.language_model."


def test_unknown_family_names_the_model_type_what_runs_and_the_hf_fallback():
    with pytest.raises(ConfigError, match=r"at 'model.path'.*'mamba_x' is no family.*native engine runs \[.*'qwen3'.*engine.backend: hf"):
        families.family_of({**QWEN2, "model_type": "mamba_x"})
    with pytest.raises(ConfigError, match=r"at 'engine.backend': native: model_type 'mamba_x'"):
        families.native_family({**QWEN2, "model_type": "mamba_x"})
    assert families.find_family({**QWEN2, "model_type": "mamba_x"}) is None


def test_window_is_hf_sliding_window():
    """A query at p attends to keys p - window < j <= p: HF's ``kv_idx > q_idx - sliding_window``."""
    from transformers.masking_utils import sliding_window_overlay

    for window in (1, 2, 3, 8):
        cache = LayerCache(kind="window_kv", kv_heads=1, head_dim=4, window=window)
        hf = sliding_window_overlay(window)
        for q in range(12):
            assert [j >= cache.first_key(q) for j in range(q + 1)] == [bool(hf(0, 0, q, j)) for j in range(q + 1)]
    assert LayerCache(kind="full_kv", kv_heads=1, head_dim=4).first_key(100) == 0


def test_kv_and_state_bytes_hand_computed():
    full = LayerCache(kind="full_kv", kv_heads=2, head_dim=16)
    win = LayerCache(kind="window_kv", kv_heads=2, head_dim=16, window=8)
    rec = LayerCache(kind="recurrent", state_shapes=((4, 3, 32), (4, 16, 16)), state_dtype="float32")
    caches = [full, win, rec]
    assert families.kv_bytes_per_token(caches, 2, 1) == 2 * (2 * 2 * 16 * 2)  # K and V, two KV layers, bf16
    assert families.kv_bytes_per_token(caches, 2, 4) == 2 * (2 * 1 * 16 * 2)  # KV heads replicated past TP 2
    per_tok_layer = 2 * 2 * 16 * 2
    assert families.kv_bytes_per_sequence(caches, 5, 2, 1) == 2 * 5 * per_tok_layer
    assert families.kv_bytes_per_sequence(caches, 100, 2, 1) == (100 + 8) * per_tok_layer
    assert families.state_bytes_per_sequence(caches, 1) == (4 * 3 * 32 + 4 * 16 * 16) * 4
    assert families.state_bytes_per_sequence(caches, 2) == (2 * 3 * 32 + 2 * 16 * 16) * 4
    assert families.layer_caches(QWEN2) == [full] * 3


@pytest.mark.parametrize("bad", [dict(kind="paged"), dict(kind="full_kv"), dict(kind="full_kv", kv_heads=1, head_dim=4, window=8),
                                 dict(kind="window_kv", kv_heads=1, head_dim=4), dict(kind="recurrent")])
def test_layer_cache_rejects_inconsistent_fields(bad):
    with pytest.raises(ValueError, match="LayerCache"):
        LayerCache(**bad)


def test_registry_imports_no_torch():
    code = ("import sys, tidal.families as f; f.families(); f.family_of({'model_type': 'qwen3'}); "
            "assert not {'torch', 'transformers', 'numpy'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lora_targets_default_to_the_family():
    from tidal.models.config import LoraConfig

    gemma = {"model_type": "gemma3_text", **{k: v for k, v in QWEN2.items() if k != "model_type"}}
    assert LoraConfig(rank=4).targets(gemma) == list(families.family_of(gemma).lora_targets)
    assert LoraConfig(rank=4).targets({"model_type": "gpt2"}) == list(families.DEFAULT_LORA_TARGETS)  # no family
    assert LoraConfig(rank=4, target_modules=["q_proj"]).targets(gemma) == ["q_proj"]
