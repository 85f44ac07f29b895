"""The qwen3_5 family's declarations against the model transformers builds: layer caches and state
bytes (what the engine's state pool allocates), the memory plan's parameter count, the FLOPs."""

import json

import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from tidal import families
from tidal.engine.native.kernels import get_ops
from tidal.engine.native.models.qwen3_5 import Qwen3_5ForCausalLM as EngineModel
from tidal.engine.native.parallel import TPGroup
from tidal.engine.native.state_pool import StatePool
from tidal.memory.plan import ModelShape, lora_params
from tidal.models.flops import FlopModel

TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4)


@pytest.fixture(scope="module")
def hf():
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT))


def test_family_covers_text_and_conditional_generation_configs():
    text = Qwen3_5TextConfig(**TEXT)
    vl = Qwen3_5Config(text_config=TEXT)
    for cfg in (text, vl, json.loads(vl.to_json_string())):
        fam = families.family_of(cfg)
        assert fam.name == "qwen3_5" and "linear_attention" in fam.packed_kernels
        caches = families.layer_caches(cfg)
        assert [c.kind for c in caches] == ["recurrent"] * 3 + ["full_kv"]
    # KV for the one full-attention layer only: 2 (K, V) x 2 heads x 16 dims x 2 bytes
    assert families.kv_bytes_per_token(caches, 2, 1) == 2 * 2 * 16 * 2


def test_state_bytes_equal_the_engine_pool(hf):
    caches = families.layer_caches(hf.config)
    model = EngineModel(hf.config, TPGroup.of(None), get_ops("torch", torch.device("cpu")), torch.float32)
    per_slot = StatePool.bytes_per_slot(model.linear_layers())
    assert families.state_bytes_per_sequence(caches, 1) == per_slot == 3 * 4 * ((2 * 16 + 64) * 3 + 4 * 8 * 16)
    assert ModelShape.from_hf_config(hf.config).state_bytes_per_sequence() == per_slot


def test_plan_params_and_flops_count_each_layer_kind(hf):
    for cfg in (hf.config, json.loads(hf.config.to_json_string())):
        shape = ModelShape.from_hf_config(cfg)
        assert shape.params() == sum(p.numel() for p in hf.parameters())
    matmul = sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear)) - hf.lm_head.weight.numel()
    flops = FlopModel.from_config(hf.config)
    assert flops.windows == (None,)  # attention in the one full-attention layer only
    assert flops.num_layers * flops.layer_params == matmul + 3 * (3 * 4 * 8 * 16)  # + the delta rule per token
    # LoRA on the family's default targets: attention and linear-attention projections
    targets = families.family_of(hf.config).lora_targets
    want = sum(8 * (m.in_features + m.out_features) for n, m in hf.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets)
    assert lora_params(ModelShape.from_hf_config(hf.config), 8, targets) == want


def test_task_architecture_builds_a_tiny_hybrid():
    from tidal.tasks.config import TaskConfig
    from tidal.tasks.model import build_model
    from tidal.tasks.tokenizer import train_tokenizer

    tok = train_tokenizer(["Calculate 1+2 3"])
    cfg = TaskConfig(name="arithmetic", architecture="qwen3_5", hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1,
                     intermediate_size=64)
    model = build_model(cfg, tok, architecture="qwen3_5")
    assert families.family_of(model.config).name == "qwen3_5"
    assert [c.kind for c in families.layer_caches(model.config)] == ["recurrent", "recurrent", "full_kv"]
    model.train()  # transformers re-kernelizes on a mode switch (kernels installed): Tidal's forward stays
    assert model.model.layers[0].linear_attn.forward.__func__.__name__ == "packed_gated_deltanet_forward"
    ids = torch.tensor([tok.encode("Calculate 1+2")])
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="num_layers >= 2"):
        build_model(TaskConfig(name="arithmetic", architecture="qwen3_5", num_layers=1), tok, architecture="qwen3_5")


def test_engine_line_says_hybrid_layers_decode_without_graphs(hf):
    from tidal.engine.backends import engine_choice

    assert engine_choice(hf.config, "native").endswith("family qwen3_5; its linear-attention layers decode without CUDA graphs)")


def test_conditional_generation_checkpoint_loads_its_text_decoder(hf, tmp_path):
    """The trainer loads a Qwen3_5ForConditionalGeneration checkpoint as its text decoder (text-only RL)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from tidal.models.loading import load_causal_lm

    vl = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)))
    vl.save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    want = vl.model.language_model.state_dict()
    for name, p in model.model.state_dict().items():
        assert torch.equal(p, want[name]), name
