"""The quickstart model: a tiny causal LM built from a config (no download): Qwen2 (dense), or a
Qwen3-MoE (``task.architecture: qwen3_moe``)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tidal.tasks.config import TaskConfig

MAX_POSITIONS = 128  # prompts are ~12 tokens and answers at most digits + 2
MOE_EXPERTS, MOE_TOP_K = 8, 2  # task.architecture=qwen3_moe: experts of intermediate_size / 2 each


def build_model(cfg: TaskConfig, tokenizer: PreTrainedTokenizerFast, max_positions: int = MAX_POSITIONS,
                architecture: str = "qwen2") -> Qwen2ForCausalLM | Qwen3MoeForCausalLM:
    """A randomly initialised fp32 model of ``cfg``'s shape (seeded by ``cfg.seed``; any config with
    the same model-shape fields works), tied embeddings, with bos/eos/pad ids taken from
    ``tokenizer`` so that ``generate`` stops on EOS. ``architecture``: ``qwen2`` or ``qwen3_moe``
    (``MOE_EXPERTS`` experts of ``intermediate_size / 2``, top-``MOE_TOP_K`` renormalised, every layer sparse)."""
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    if architecture == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                                                   moe_intermediate_size=max(1, cfg.intermediate_size // 2), norm_topk_prob=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
