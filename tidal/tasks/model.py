"""The built-in tasks' model: a tiny causal LM of ``task.architecture``'s family built from a config
(no download; :mod:`tidal.tasks.architectures`)."""

from __future__ import annotations

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from tidal import families
from tidal.models.linear_attention import enable_packed_linear_attention
from tidal.tasks.architectures import ARCHITECTURES, family_settings

MAX_POSITIONS = 128  # prompts are ~12 tokens and answers at most digits + 2


def model_config(cfg, tokenizer: PreTrainedTokenizerFast, max_positions: int = MAX_POSITIONS, *,
                 architecture: str = "qwen2") -> transformers.PretrainedConfig:
    """The Hugging Face config of :func:`build_model`'s model (no weights made)."""
    config_name, _ = ARCHITECTURES[architecture]
    return getattr(transformers, config_name)(
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
        **family_settings(architecture, head_dim=cfg.hidden_size // cfg.num_heads, num_layers=cfg.num_layers,
                          intermediate_size=cfg.intermediate_size),
    )


def build_model(cfg, tokenizer: PreTrainedTokenizerFast, max_positions: int = MAX_POSITIONS, *,
                architecture: str = "qwen2") -> PreTrainedModel:
    """A randomly initialised fp32 causal LM of ``architecture`` in ``cfg``'s shape (any config with
    the task's model-shape fields; seeded by ``cfg.seed``), tied embeddings, with bos/eos/pad ids
    taken from ``tokenizer`` so that ``generate`` stops on EOS."""
    _, model_name = ARCHITECTURES[architecture]
    config = model_config(cfg, tokenizer, max_positions, architecture=architecture)
    torch.manual_seed(cfg.seed)
    model = getattr(transformers, model_name)(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    if "linear_attention" in families.family_of(config).packed_kernels:
        enable_packed_linear_attention(model)  # the warm start's padded forwards run Tidal's kernels, not HF's slow fallback
    return model
