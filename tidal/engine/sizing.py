"""Sizing facts of a model for an engine, from its HF config alone (no engine import): KV bytes per
token, weight bytes per TP rank, EOS ids, and the device's free memory as the driver sees it."""

from __future__ import annotations

import torch


def kv_bytes_per_token(hf_config, dtype: torch.dtype, tp_size: int) -> int:
    """KV-cache bytes of one token on one TP rank (K and V of every layer; KV heads are replicated
    when there are fewer than ``tp_size``)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads_per_rank = max(1, kv_heads // tp_size)
    return 2 * hf_config.num_hidden_layers * kv_heads_per_rank * head_dim * torch.empty(0, dtype=dtype).element_size()


def weight_bytes_per_rank(hf_config, dtype: torch.dtype, tp_size: int) -> int:
    """Approximate device bytes of the weights on one TP rank (parameters counted on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    n = sum(p.numel() for p in model.parameters())
    return n * torch.empty(0, dtype=dtype).element_size() // tp_size


def device_free_bytes(device: torch.device) -> int:
    """Free device memory as the driver sees it (vLLM's sleep mode unmaps memory behind PyTorch's
    allocator, so allocator statistics would miss it); 0 on CPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def eos_ids(hf_config) -> set[int]:
    value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}
