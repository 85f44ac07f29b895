"""Tensor-parallel building blocks. Each layer owns how a full (unsharded) HF tensor lands in its shard:
``weight_slices(param, full_tensor, shard_id)`` gives the (destination view of ``param``, source view
of the full tensor) pairs -- a None source means zeros -- that loading copies in place (no
reallocation) and that weight-sync verification compares.

Column-parallel layers split the output dim over the TP group, row-parallel ones the input dim
(followed by an all-reduce); vocabulary-parallel embedding / LM head split the vocabulary
(padded up to a multiple of the TP size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.engine.native.parallel import TPGroup


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}={a} is not divisible by the TP size {b}")
    return a // b


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel linears sharing the input, stored as one (gate_up); shard_id is the index."""

    def __init__(self, in_features, out_sizes: list[int], bias, tp, dtype):
        self.out_sizes = [_divide(s, tp.size, "out_features") for s in out_sizes]
        super().__init__(in_features, sum(self.out_sizes), bias, tp, dtype)

    def weight_slices(self, param, full, shard_id: int):
        n = self.out_sizes[shard_id]
        return [(param.data.narrow(0, sum(self.out_sizes[:shard_id]), n), full.narrow(0, self.tp.rank * n, n))]


class QKVParallelLinear(_Linear):
    """q, k and v projections as one linear, split by heads. When there are fewer KV heads than TP
    ranks, each KV head is replicated on ``tp.size // num_kv_heads`` consecutive ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias, tp, dtype):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_rank = tp.rank
        else:
            _divide(tp.size, num_kv_heads, "tp_size / num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_rank = tp.rank // (tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out, bias, tp, dtype)

    def weight_slices(self, param, full, shard_id: str):
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size, rank = {"q": (0, q, self.tp.rank), "k": (q, kv, self.kv_rank), "v": (q + kv, kv, self.kv_rank)}[
            shard_id
        ]
        return [(param.data.narrow(0, offset, size), full.narrow(0, rank * size, size))]


class RowParallelLinear(_Linear):
    """``y = sum_r x_r W_r^T + b`` with W's columns (input features) split; all-reduce over the group."""

    def __init__(self, in_features, out_features, bias, tp, dtype):
        super().__init__(_divide(in_features, tp.size, "in_features"), out_features, bias, tp, dtype)

    def weight_slices(self, param, full, shard_id=None):
        if param.dim() == 1:  # the bias is added once, after the reduction
            return [(param.data, full)]
        n = param.shape[1]
        return [(param.data, full.narrow(1, self.tp.rank * n, n))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp.is_first else None)
        return self.tp.all_reduce(y)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the TP group (shards padded with zero rows)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = (vocab_size + tp.size - 1) // tp.size
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        rows = full[self.start : self.start + self.shard]
        return [(param.data[: rows.shape[0]], rows), (param.data[rows.shape[0] :], None)]  # padding rows: zeros

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids_T, self.weight)
        local = ids_T - self.start
        inside = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary shard, gathered on TP rank 0 (other ranks get None).
    With tied embeddings it reuses the embedding's parameter and loads nothing itself."""

    def __init__(self, embed: VocabParallelEmbedding, tie: bool, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = embed.vocab_size
        self.tied = tie
        if tie:
            self.weight = embed.weight
        else:
            self.weight = nn.Parameter(torch.zeros_like(embed.weight), requires_grad=False)
            self._slices = embed.weight_slices

    def weight_slices(self, param, full, shard_id=None):
        return self._slices(param, full)

    def forward(self, hidden_BH: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_last_dim(F.linear(hidden_BH, self.weight))
        return None if logits is None else logits[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (``forward(x, residual) -> (y, x + residual)``)."""

    def __init__(self, dim: int, eps: float, ops, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def weight_slices(self, param, full, shard_id=None):
        return [(param.data, full)]

    def forward(self, x, residual=None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_cos_sin(hf_config, head_dim: int, max_positions: int, dtype: torch.dtype, layer_type: str | None = None) -> torch.Tensor:
    """``[max_positions, head_dim]`` table of ``[cos | sin]`` (half each), scaled as HF's rotary
    embedding does for the config's ``rope_parameters`` (default, linear, llama3, yarn, ...).
    ``layer_type``: for configs whose ``rope_parameters`` are per layer type (Gemma 3, OLMo 3:
    ``{"full_attention": {...}, "sliding_attention": {...}}``), that type's."""
    params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise NotImplementedError("dynamic RoPE scaling changes with the sequence length; not supported")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        kw = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kw)
    pos = torch.arange(max_positions, dtype=torch.float)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).to(dtype)
