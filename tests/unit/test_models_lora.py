"""LoRA actor: merged HF-named weights equal PEFT's own merge, the adapter-disabled reference equals
the base model, config validation, export in PEFT and merged formats."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tidal.config_base import ConfigError, build
from tidal.models.config import LoraConfig, ModelConfig
from tidal.models.logprobs import attach_logprob_method, token_logprobs
from tidal.models.lora import AdapterDisabledReference, apply_lora, hf_weights, is_lora, merged_state_dict, peft_model, save_hf


def tiny_lm(seed: int = 0, tie: bool = True) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    model = Qwen2ForCausalLM(cfg)
    attach_logprob_method(model)
    return model


def lora_lm(rank=4, alpha=8.0, seed=0, tie=True):
    base = tiny_lm(seed, tie)
    ref = copy.deepcopy(base)
    attach_logprob_method(ref)
    model = apply_lora(base, LoraConfig(rank=rank, alpha=alpha))
    with torch.no_grad():  # PEFT starts B at 0 (a no-op adapter): make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model, ref


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    return ids, am


def test_disabled_lora_returns_model_unchanged():
    m = tiny_lm()
    assert apply_lora(m, LoraConfig(rank=0)) is m
    assert not is_lora(m)


def test_only_adapters_train():
    model, _ = lora_lm()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 projections x (A, B)
    assert len(trainable) == 2 * 7 * 2


@pytest.mark.parametrize("tie", [True, False])
def test_merged_weights_equal_peft_merge(tie):
    model, _ = lora_lm(tie=tie)
    got = dict(hf_weights(model, lambda p: p.detach()))
    ref_model = copy.deepcopy(model).merge_and_unload()
    want = dict(ref_model.named_parameters())
    assert sorted(got) == sorted(want)
    assert not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n in got)
    for n, t in want.items():
        torch.testing.assert_close(got[n], t.detach(), rtol=1e-5, atol=1e-6, msg=n)
    # and by hand for one projection: W + (alpha / r) * B @ A
    inner = model.get_base_model().model.layers[1].self_attn.q_proj
    w = inner.base_layer.weight + (8.0 / 4) * inner.lora_B["default"].weight @ inner.lora_A["default"].weight
    torch.testing.assert_close(got["model.layers.1.self_attn.q_proj.weight"], w.detach())
    assert not torch.allclose(w, inner.base_layer.weight)


def test_merged_state_dict_matches_streamed_weights():
    model, _ = lora_lm()
    sd = merged_state_dict(model, model.state_dict())
    streamed = dict(hf_weights(model, lambda p: p.detach()))
    for n, t in streamed.items():
        torch.testing.assert_close(sd[n], t)


def test_reference_is_base_with_adapters_disabled():
    model, base = lora_lm()
    ids, am = batch()
    with torch.no_grad():
        ref_logp, _ = token_logprobs(AdapterDisabledReference(model), ids, am)
        base_logp, _ = token_logprobs(base, ids, am)
        actor_logp, _ = token_logprobs(model, ids, am)
    torch.testing.assert_close(ref_logp, base_logp, rtol=1e-5, atol=1e-6)
    assert (actor_logp - base_logp).abs().max() > 1e-3  # the adapters are on again after the reference
    assert list(AdapterDisabledReference(model).parameters()) == []  # owns no weights: nothing to offload


def test_export_merged_and_adapter(tmp_path):
    model, _ = lora_lm()
    save_hf(model, model.state_dict(), tmp_path)
    ids, am = batch()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    from peft import PeftModel

    fresh = tiny_lm()  # the same seed: the same base weights as before adapters were added
    peft_loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am).logits
        torch.testing.assert_close(merged(input_ids=ids, attention_mask=am).logits, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(peft_loaded(input_ids=ids, attention_mask=am).logits, want, rtol=1e-4, atol=1e-5)


def test_lora_config_errors():
    with pytest.raises(ConfigError, match="rank"):
        LoraConfig(rank=-1)
    with pytest.raises(ConfigError, match="dropout"):
        LoraConfig(rank=4, dropout=1.0)
    with pytest.raises(ConfigError, match="target_modules"):
        LoraConfig(rank=4, target_modules=[])
    with pytest.raises(ConfigError, match="model.reference_path"):
        build(ModelConfig, {"path": "a", "reference_path": "b", "lora": {"rank": 8}}, prefix="model")
    cfg = build(ModelConfig, {"path": "a", "lora": {"rank": 8, "alpha": 16}}, prefix="model")
    assert cfg.lora.enabled and not ModelConfig().lora.enabled


def test_unknown_target_module_names_the_key():
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        apply_lora(tiny_lm(), LoraConfig(rank=2, target_modules=["no_such_proj"]))


def test_adapters_get_gradients_under_gradient_checkpointing():
    base = tiny_lm()
    base.gradient_checkpointing_enable()
    model = apply_lora(base, LoraConfig(rank=2), seed=0)
    model.train()
    ids, am = batch()
    logp, _ = token_logprobs(model, ids, am)
    (-(logp * am).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    assert any(float(g.abs().sum()) > 0 for n, g in grads.items() if "lora_A" in n or "lora_B" in n)


def test_adapter_init_depends_on_seed_only():
    def adapters(global_seed, seed):
        model = tiny_lm()
        torch.manual_seed(global_seed)  # whatever ran before in the process
        return {n: p.detach().clone() for n, p in apply_lora(model, LoraConfig(rank=2), seed=seed).named_parameters() if "lora_A" in n}

    a, b, c = adapters(123, 5), adapters(456, 5), adapters(123, 6)
    assert all(torch.equal(a[n], b[n]) for n in a) and not all(torch.equal(a[n], c[n]) for n in a)


def test_peft_model_is_found_inside_a_training_engine_wrapper():
    model, base = lora_lm()

    class Engine(torch.nn.Module):  # what a DeepSpeedEngine looks like to lora.py: .module + forwarding
        def __init__(self, module):
            super().__init__()
            self.module = module

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.module, name)

    engine = Engine(model)
    assert peft_model(engine) is model and peft_model(model) is model and is_lora(engine)
    assert peft_model(base) is None and not is_lora(Engine(base))
    ids, am = batch()
    with torch.no_grad():
        ref_logp, _ = token_logprobs(AdapterDisabledReference(engine), ids, am)
        base_logp, _ = token_logprobs(base, ids, am)
    torch.testing.assert_close(ref_logp, base_logp, rtol=1e-5, atol=1e-6)
