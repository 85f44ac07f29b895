"""Device ceilings measured in the run, and each phase's lower bound from bytes moved and FLOPs,
counting real tokens only (no padding, no recompute).

Notation: N_body = matmul weights of the decoder layers, N_head = the LM head's (V x H), N_mm =
N_body + N_head, N = all parameters; per sequence P prompt and L completion tokens, S = P + L;
layers l, attention width d = heads x head_dim; the two ceilings ``copy_bw`` (bytes read + written
per second) and ``matmul`` (bf16 FLOP/s).

- forward (old logprobs, reference): ``2 N_body S + 2 N_head L`` (the LM head only where a logprob
  is needed) plus causal attention ``2 l d S (S + 1)`` (QK^T and AV), per sequence, over ``matmul``.
- teacher forward (distillation, ``teacher_logprobs``): the same forward with the teacher's shape.
- train: 3 x the forward FLOPs (forward + backward; the 6N-per-token rule with attention), over
  ``matmul``, plus the fp32 AdamW update, 28 bytes per parameter (read weight, grad, two moments;
  write weight and moments), over ``copy_bw``. MFU of the train phase: those FLOPs / (seconds x matmul).
- generate: prefill of the unique prompts (forward FLOPs of P tokens, the LM head on the last) over
  ``matmul``, then one decode step per k = 1 .. max(L) - 1 with the r_k sequences still running
  (L > k), each ``max((2 N_mm + r_k (P + k) kv_bytes) / copy_bw, (2 N_mm r_k + 4 l d r_k (P + k)) /
  matmul)``: bf16 weights read once, the KV of every running sequence read once. For a mixture of
  experts, ``N_mm`` of a decode step is its dense weights, the LM head and the routed experts the step
  touched (the union over its rows: the engine's ``moe_experts_touched`` per decode step, or without
  it the ``top_k`` per MoE layer no step can go below); FLOPs count the active experts.
- weight sync: ``6 N / copy_bw`` (read the fp32 master weights, write the bf16 engine copy).
- No bound for engine wake/sleep, reward, advantages.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from bench.grpo.shapes import (attended_tokens, attention_dim, attention_layers, body_matmul_params, decode_matmul_params,
                               head_params, kv_bytes_per_sequence, param_count)

ADAMW_BYTES_PER_PARAM = 28
WEIGHT_SYNC_BYTES_PER_PARAM = 6


@dataclasses.dataclass(kw_only=True, frozen=True)
class Ceilings:
    copy_bw: float  # bytes read + written per second
    matmul_flops: float  # bf16 FLOP/s


def measure_ceilings() -> Ceilings:
    """Both ceilings on the current CUDA device."""
    return Ceilings(copy_bw=copy_bandwidth(), matmul_flops=matmul_rate())


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s counting bytes read plus written (median of 20 after 5 warm-ups)."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = _event_times(lambda: dst.copy_(src), 25, 5)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def matmul_rate(n: int = 8192) -> float:
    """bf16 n x n x n matmul FLOP/s on random data (median of 10 after 3 warm-ups)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = _event_times(lambda: a @ b, 13, 3)
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n**3 / statistics.median(times)


def _event_times(fn, total: int, skip: int) -> list[float]:
    import torch

    out = []
    for i in range(total):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= skip:
            out.append(start.elapsed_time(end) / 1e3)
    return out


# ---- FLOPs and bytes --------------------------------------------------------------------------------
def attention_flops(shape: dict, seq_lens) -> float:
    """Causal self-attention forward FLOPs of whole sequences: ``2 l d S (S + 1)`` each (``l``: the
    layers that attend; a window layer counted as full: an upper count, kept for simplicity)."""
    s = np.asarray(seq_lens, dtype=np.float64)
    return float(2.0 * attention_layers(shape) * attention_dim(shape) * (s * (s + 1)).sum())


def forward_flops(shape: dict, prompt_len: int, completion_lens) -> float:
    """A forward over prompt + completion of each sequence, the LM head on the completion tokens."""
    lens = np.asarray(completion_lens, dtype=np.float64)
    seq = prompt_len + lens
    return float(2.0 * body_matmul_params(shape) * seq.sum() + 2.0 * head_params(shape) * lens.sum()
                 + attention_flops(shape, seq))


def train_flops(shape: dict, prompt_len: int, completion_lens) -> float:
    """Forward + backward: three forwards' FLOPs (recompute not counted)."""
    return 3.0 * forward_flops(shape, prompt_len, completion_lens)


def generation_bound_s(shape: dict, *, prompt_len: int, unique_prompts: int, completion_lens, c: Ceilings,
                       experts_touched: float | None = None) -> float:
    """Prefill of the unique prompts, then every decode step with the sequences still running
    (``experts_touched``: an MoE's distinct experts per decode step, summed over its layers)."""
    prefill = unique_prompts * (2.0 * body_matmul_params(shape) * prompt_len + 2.0 * head_params(shape)) \
        + attention_flops(shape, [prompt_len] * unique_prompts)
    lens = np.sort(np.asarray(completion_lens, dtype=np.int64))
    k = np.arange(1, int(lens.max()) if len(lens) else 1, dtype=np.float64)  # decode steps 1 .. max(L) - 1
    running = len(lens) - np.searchsorted(lens, k, side="right")  # sequences with L > k
    # KV read and keys attended at step k: every token of a full layer, at most its window of a window layer
    kv_read = running * kv_bytes_per_sequence(shape, prompt_len + k)
    read_s = (2.0 * decode_matmul_params(shape, experts_touched) + kv_read) / c.copy_bw
    active = body_matmul_params(shape) + head_params(shape)
    flops_s = (2.0 * active * running + 4.0 * attention_dim(shape) * running * attended_tokens(shape, prompt_len + k)) / c.matmul_flops
    return prefill / c.matmul_flops + float(np.maximum(read_s, flops_s).sum())


def phase_bounds(shape: dict, *, prompt_len: int, unique_prompts: int, completion_lens, c: Ceilings,
                 old_logprobs: bool, kl: bool, teacher_shape: dict | None = None,
                 experts_touched: float | None = None) -> dict[str, float]:
    """Lower bound in seconds of each phase that has one (module docstring). ``old_logprobs``: the
    run had a separate old-logprob pass (else the update's forward gave them); ``kl``: a reference
    pass; ``teacher_shape``: a distillation teacher's shape (its forward, ``teacher_logprobs``), or None;
    ``experts_touched``: an MoE's distinct experts per decode step (:func:`generation_bound_s`)."""
    n = param_count(shape)
    fwd = forward_flops(shape, prompt_len, completion_lens) / c.matmul_flops
    out = {
        "generate": generation_bound_s(shape, prompt_len=prompt_len, unique_prompts=unique_prompts,
                                       completion_lens=completion_lens, c=c, experts_touched=experts_touched),
        "train": 3.0 * fwd + ADAMW_BYTES_PER_PARAM * n / c.copy_bw,
        "weight_sync": WEIGHT_SYNC_BYTES_PER_PARAM * n / c.copy_bw,
    }
    if old_logprobs:
        out["actor_logprobs"] = fwd
    if kl:
        out["reference_logprobs"] = fwd
    if teacher_shape is not None:
        out["teacher_logprobs"] = forward_flops(teacher_shape, prompt_len, completion_lens) / c.matmul_flops
    return out


def train_mfu(shape: dict, *, prompt_len: int, completion_lens, seconds: float, c: Ceilings) -> float | None:
    """Model FLOPs utilisation of a train phase against the measured bf16 ceiling (None without time)."""
    if not seconds:
        return None
    return train_flops(shape, prompt_len, completion_lens) / (seconds * c.matmul_flops)
