"""Tiny random HF models (Qwen2, Qwen3, Llama) and a NativeEngine loaded with the same weights."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tidal.engine.config import EngineConfig
from tidal.engine.native import NativeEngine

COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    vocab_size=128, max_position_embeddings=256, initializer_range=0.2,
)
FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=False)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )),
}


def tiny_hf(family: str = "qwen2", seed: int = 0, **overrides):
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = cfg_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if family == "qwen2":  # HF initialises biases to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.2)
    return model


def engine_for(hf_model, device: str = "cpu", **cfg) -> NativeEngine:
    engine = NativeEngine(hf_model.config, EngineConfig(**{"block_size": 4, **cfg}), device=torch.device(device),
                          dtype=torch.float32)
    engine.load_weights(hf_model.state_dict().items())
    return engine


def hf_greedy(hf_model, prompt: list[int], n_new: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt], device=hf_model.device), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [[3, 17, 99, 5, 42, 8, 61], [11, 12], list(range(20, 41)), [7]]


class OracleDrafter:
    """A stand-in for the speculative draft index (``engine.spec.index``) that drafts from known
    continuations: ``refs[tuple(prompt)]`` is the sequence each prompt's samples should produce.
    ``mode``: ``always`` (the reference's next tokens), ``never`` (each shifted by one: always
    rejected under greedy), ``partly`` (the first ``len // 2`` right, the rest wrong), ``fixed``
    (``refs[prompt]`` after the prompt, whatever was generated). ``skip(seq_id)``: sequences that
    get no draft (plain rows beside verify rows)."""

    def __init__(self, refs: dict, mode: str, vocab: int, skip=lambda seq_id: False):
        self.refs, self.mode, self.vocab, self.skip = refs, mode, vocab, skip
        self.prompts = {}

    def add(self, seq_id, prompt_ids, group_id):
        self.prompts[seq_id] = tuple(prompt_ids)

    def update(self, seq_id, row):
        pass

    def finish(self, seq_id, row):
        del self.prompts[seq_id]

    def propose(self, seq_id, row, k):
        if self.skip(seq_id):
            return None
        prompt = self.prompts[seq_id]
        ref = self.refs[prompt]
        done = len(row) - len(prompt)
        nxt = list(ref[:k]) if self.mode == "fixed" else list(ref[done : done + k])
        if self.mode == "never":
            nxt = [(x + 1) % self.vocab for x in nxt]
        elif self.mode == "partly":
            nxt = nxt[: len(nxt) // 2] + [(x + 1) % self.vocab for x in nxt[len(nxt) // 2 :]]
        return np.array(nxt, dtype=np.int64) if nxt else None


MOE_COMMON = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
    max_position_embeddings=256, initializer_range=0.2, num_experts=8, num_experts_per_tok=3,
)
MOE_FAMILIES = {
    # layer 1 keeps a dense MLP (mlp_only_layers): a mixed stack, as released Qwen3-MoE configs allow
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=32, clip_qkv=3.0, norm_topk_prob=False)),
    # the hybrid backbone (two Gated DeltaNet layers, then gated full attention), every layer sparse
    # with the shared expert and its sigmoid gate
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"])),
}


def tiny_moe(family: str = "qwen3_moe", seed: int = 0, **overrides):
    """A tiny random MoE built by ``transformers`` (8 experts, top-3)."""
    import transformers

    cfg_name, model_name, extra = MOE_FAMILIES[family]
    config = getattr(transformers, cfg_name)(**{**MOE_COMMON, **extra, **overrides})
    config.eos_token_id = None
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    if family == "qwen3_5_moe":  # HF initialises the norms to 0/1 and A_log, dt_bias to fixed values
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(("A_log", "dt_bias")):
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model
