"""`tidal export` keeps the dtype the model trained in (strategy.param_dtype), not the fp32 master copy."""

import json
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tidal.trainer.export import export_hf


def _trainer(param_dtype):
    model = AutoModelForCausalLM.from_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    strategy = SimpleNamespace(param_dtype=param_dtype, full_model_state_dict=lambda m: m.state_dict())
    return SimpleNamespace(colocation=SimpleNamespace(strategy=strategy),
                           models=SimpleNamespace(actor=SimpleNamespace(model=model),
                                                  tokenizer=SimpleNamespace(save_pretrained=lambda path: None)),
                           rt=SimpleNamespace(is_main=True, barrier=lambda: None)), model


def test_export_writes_the_training_dtype_unless_asked(tmp_path):
    trainer, model = _trainer(torch.bfloat16)
    assert model.dtype == torch.float32  # the master weights
    out = export_hf(trainer, str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert loaded.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ref = model.state_dict()["lm_head.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], ref)
    out = export_hf(trainer, str(tmp_path / "hf32"), torch.float32)  # asked otherwise
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.float32
