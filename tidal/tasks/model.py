"""The quickstart model: a tiny Qwen2 causal LM built from a config (no download)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tidal.tasks.config import TaskConfig

MAX_POSITIONS = 128  # prompts are ~12 tokens and answers at most digits + 2


def build_model(cfg: TaskConfig, tokenizer: PreTrainedTokenizerFast, max_positions: int = MAX_POSITIONS) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 Qwen2 of ``cfg``'s shape (seeded by ``cfg.seed``; any config with
    the same model-shape fields works), tied embeddings, with bos/eos/pad ids taken from
    ``tokenizer`` so that ``generate`` stops on EOS."""
    config = Qwen2Config(
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
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
