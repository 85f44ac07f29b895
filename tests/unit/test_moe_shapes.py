"""MoE shapes as the families declare them: which layers are sparse, total vs active parameters in
the memory plan, FLOPs by active parameters, and LoRA adapter counts on experts -- against the
parameters of tiny models built by transformers (Qwen3.5-MoE: on the hybrid backbone, with the
shared expert and its gate)."""

import pytest

from tests.engine.helpers import tiny_moe
from tidal import families
from tidal.memory.plan import ModelShape, lora_params
from tidal.models.flops import FlopModel


def test_qwen3_moe_sparse_layers_follow_the_step_and_mlp_only_layers():
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 16, "num_experts_per_tok": 4,
           "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True}
    shape = families.family_of(cfg).moe(families.text_config(cfg))
    assert shape.dense_layers == (0, 2, 3, 4) and shape.sparse_layers(6) == [1, 5]
    assert shape.router == "softmax_topk_renorm" and shape.top_k == 4 and shape.expert_intermediate == 32
    assert families.family_of({**cfg, "num_experts": 0}).moe(families.namespace({**cfg, "num_experts": 0})) is None
    olmoe = {"model_type": "olmoe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 24}
    assert families.family_of(olmoe).moe(families.namespace(olmoe)).sparse_layers(2) == [0, 1]


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen3_5_moe"])
def test_total_and_active_parameters_are_the_models(family):
    hf = tiny_moe(family)
    c = hf.config
    shape = ModelShape.from_hf_config(c)
    # OLMoE's q/k RMSNorms span all heads: its family's qk_norm "projection" counts q_dim + kv_dim weights
    assert shape.params() == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    k, e = c.num_experts_per_tok, c.num_experts
    assert shape.active_params() == shape.params() - experts + experts * k // e
    biggest = max(sum(p.numel() for p in layer.parameters()) for layer in hf.model.layers)
    assert shape.layer_params() + uncounted // c.num_hidden_layers == biggest  # what FSDP gathers at once: a sparse layer with all its experts


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen3_5_moe"])
def test_flops_count_the_active_experts(family):
    hf = tiny_moe(family)
    c = hf.config
    fm = FlopModel.from_config(c)
    per_layer = []
    for layer in hf.model.layers:
        # attention (or Gated DeltaNet: its projections), router, dense MLP or shared expert and its gate
        mats = sum(p.numel() for n, p in layer.named_parameters() if p.ndim == 2)
        experts = sum(p.numel() for n, p in layer.named_parameters() if p.ndim == 3 and ".experts." in n)
        delta_rule = 0
        if getattr(layer, "linear_attn", None) is not None:  # the delta rule's 3 Hv dk dv per token
            delta_rule = 3 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        per_layer.append(mats + experts * c.num_experts_per_tok // c.num_experts + delta_rule)
    assert fm.body == sum(per_layer) and fm.params == sum(per_layer) + hf.lm_head.weight.numel()
    attention_layers = len(fm.windows) or fm.num_layers  # a hybrid's linear layers compute no attention
    assert fm.train_flops([10], head_tokens=0) == pytest.approx(6 * fm.body * 10 + 6 * attention_layers * fm.attn_dim * 100)


def test_lora_parameter_count_matches_peft_on_attention_and_experts():
    from tidal.models.config import LoraConfig
    from tidal.models.lora import apply_lora

    def trained(targets, experts=()):
        hf = tiny_moe("qwen3_moe", mlp_only_layers=[])
        actor = apply_lora(hf, LoraConfig(rank=4, target_modules=list(targets), target_parameters=list(experts)))
        return ModelShape.from_hf_config(hf.config), sum(p.numel() for p in actor.parameters() if p.requires_grad)

    both = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    for targets, experts in [(("q_proj", "v_proj"), both), (("q_proj", "v_proj"), ()), (("q_proj", "down_proj"), ())]:
        shape, n = trained(targets, experts)
        assert lora_params(shape, 4, targets, experts) == n, (targets, experts)


def test_qwen3_5_moe_lora_parameter_count_matches_peft():
    """Attention, Gated DeltaNet and shared-expert projections, and PEFT's match of ``down_proj``
    against every routed expert's stacked weight (the family's default targets)."""
    from tidal.models.config import LoraConfig
    from tidal.models.lora import apply_lora

    targets = families.family_of({"model_type": "qwen3_5_moe_text"}).lora_targets
    hf = tiny_moe("qwen3_5_moe")
    actor = apply_lora(hf, LoraConfig(rank=4, target_modules=list(targets)))
    n = sum(p.numel() for p in actor.parameters() if p.requires_grad)
    assert lora_params(ModelShape.from_hf_config(hf.config), 4, targets) == n


def test_a_35b_a3b_shape_has_about_3b_active_parameters():
    cfg = {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
           "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
           "num_experts": 256, "num_experts_per_tok": 8, "vocab_size": 248320, "tie_word_embeddings": False,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10}
    shape = ModelShape.from_hf_config(cfg)
    # Qwen3.5-35B-A3B: 35B total, 3B active (its vision tower and MTP head not counted: 34.7B, 3.45B with the embeddings)
    assert 34.5e9 < shape.params() < 35.5e9 and 3.0e9 < shape.active_params() < 3.6e9
    assert shape.state_bytes_per_sequence() > 0 and shape.kv_cache_bytes_per_token() == 10 * 2 * 2 * 256 * 2


def test_a_30b_a3b_shape_has_about_3b_active_parameters():
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
           "norm_topk_prob": True}
    shape = ModelShape.from_hf_config(cfg)
    assert 30.4e9 < shape.params() < 30.6e9 and 3.2e9 < shape.active_params() < 3.4e9  # Qwen3-30B-A3B: 30.5B, 3.3B


def test_decode_floor_reads_the_experts_a_step_touches():
    """bench/grpo: a decode step of a 30B-A3B reads its dense weights, the LM head and the routed
    experts it touched; without the engine's count, the top-k per layer no step goes below."""
    from bench.grpo.bounds import Ceilings, generation_bound_s
    from bench.grpo.shapes import SHAPES, body_matmul_params, decode_matmul_params, expert_matmul_params, param_count

    s = SHAPES["30b-a3b"]
    expert = 3 * 2048 * 768
    assert expert_matmul_params(s) == expert
    floor = decode_matmul_params(s)
    assert decode_matmul_params(s, 48 * 128) - floor == (48 * 128 - 48 * 8) * expert  # every expert touched
    assert decode_matmul_params(s, 48 * 8) == floor
    assert floor - 151936 * 2048 == body_matmul_params(s)  # one row: its active weights are what it reads
    assert param_count(s) == ModelShape.from_hf_config(s).params()
    c = Ceilings(copy_bw=1e12, matmul_flops=1e18)  # bandwidth-bound decode
    one = generation_bound_s(s, prompt_len=1, unique_prompts=1, completion_lens=[3], c=c, experts_touched=48 * 8)
    many = generation_bound_s(s, prompt_len=1, unique_prompts=1, completion_lens=[3], c=c, experts_touched=48 * 64)
    assert many - one == pytest.approx(2 * 2 * (48 * 56) * expert / 1e12)  # two decode steps, bf16 bytes


def test_qwen3_5_moe_family_covers_text_and_conditional_generation_configs_and_the_state_pool():
    import json

    import transformers

    from tests.engine.helpers import MOE_COMMON, MOE_FAMILIES, engine_for
    from tidal.engine.native.state_pool import StatePool

    text = {**MOE_COMMON, **MOE_FAMILIES["qwen3_5_moe"][2]}
    vl = transformers.Qwen3_5MoeConfig(text_config=text)
    for cfg in (transformers.Qwen3_5MoeTextConfig(**text), vl, json.loads(vl.to_json_string())):
        fam = families.family_of(cfg)
        assert fam.name == "qwen3_5_moe" and "linear_attention" in fam.packed_kernels
        assert [c.kind for c in families.layer_caches(cfg)] == ["recurrent", "recurrent", "full_kv"]
        m = fam.moe(families.text_config(cfg))
        assert (m.experts, m.top_k, m.shared_experts, m.shared_intermediate, m.router) == (8, 3, 1, 48, "softmax_topk_renorm")
        assert ModelShape.from_hf_config(cfg).params() == ModelShape.from_hf_config(text | {"model_type": "qwen3_5_moe_text"}).params()
    engine = engine_for(tiny_moe("qwen3_5_moe"))
    per_slot = StatePool.bytes_per_slot(engine.model.linear_layers())
    assert ModelShape.from_hf_config(vl).state_bytes_per_sequence() == per_slot > 0
