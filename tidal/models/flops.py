"""Model FLOPs of training and forward passes, and model FLOPs utilisation (MFU).

Counted per the usual convention (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B):
a token costs ``2 * P`` FLOPs forward through ``P`` matmul weights and ``4 * P`` backward, so training
costs ``6 * P`` per token; causal self-attention adds, per layer and sequence of length L,
``2 * L^2 * d_attn`` forward (``QK^T`` and ``PV`` over the L^2/2 visible pairs, a multiply-add each,
``d_attn`` = query heads x head dim) and twice that backward: ``6 * L^2 * d_attn`` in training.
A sliding-window layer of window W sees ``W^2/2 + (L - W) W`` pairs instead of ``L^2/2`` once
``L > W``; a layer without KV (recurrent, :mod:`tidal.families`) has no attention term here.

Only real tokens count (packing's padding and dummy sequences do not), and recomputation is not
counted (gradient checkpointing re-runs forwards; model FLOPs stay the same). The LM head counts on
``head_tokens`` tokens (default: all; Tidal's head runs on response tokens only, pass their count to
count what it computes). Embedding lookups, norms, activations and the softmax are left out (a few
percent), as in the convention. A mixture-of-experts layer counts the weights a token goes through:
its router and its ``top_k`` routed experts (and any shared experts), not the experts it skips (the
active parameters; the family's :class:`~tidal.families.MoEShape`). A LoRA update skips the
frozen weights' gradients (about ``4 * P`` per token of real work); its MFU is still reported
against ``6 * P``, like every full-model figure. The vision tower of a VL model is not counted.

Hybrid models (Qwen3.5: Gated DeltaNet layers beside full-attention ones, as the family's layer
caches say): the projections of each kind of layer count as above, causal attention only in the
full-attention layers, and a linear-attention layer's delta rule ``6 * Hv * dk * dv`` per token
forward (reading, updating and querying each head's ``dk x dv`` state, a multiply-add each), i.e.
``3 * Hv * dk * dv`` matmul-equivalent weights per token.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tidal import families


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlopModel:
    """A decoder-only LM's matmul shape. layer_params: matmul weights a token goes through per decoder
    layer (attention projections and the gated MLP; an MoE layer's router and active experts).
    head_params: the output head's (vocab x hidden). attn_dim: query heads x head dim. windows: the
    sliding window of each attention layer (None: full attention; empty: every layer full).
    body_params: the weights a token goes through in all layers when they differ (an MoE with dense
    layers, a hybrid's linear-attention layers beside its full ones: layer_params is then their
    mean, delta-rule work included as weights), None when every layer is ``layer_params``."""

    num_layers: int
    layer_params: int
    head_params: int
    attn_dim: int
    windows: tuple[int | None, ...] = ()
    body_params: int | None = None

    @classmethod
    def from_config(cls, config) -> "FlopModel":
        """From an HF config of a decoder with a gated MLP (Qwen2/2.5/3, Llama, Mistral; the MoE
        families by their active experts); a VL config's text part."""
        c = families.text_config(config)
        family = families.find_family(config)
        moe = family.moe(c) if family is not None else None
        if moe is None and (getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)):
            raise NotImplementedError(f"{c.model_type}: a mixture-of-experts model of no known family; its FLOPs are not counted")
        H, heads = int(c.hidden_size), int(c.num_attention_heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads)
        hd = int(getattr(c, "head_dim", None) or H // heads)
        attn = H * heads * hd + 2 * H * kv * hd + heads * hd * H
        caches = family.layer_caches(c) if family else []
        windows = tuple(lc.window for lc in caches if lc.has_kv)
        linear = {i for i, lc in enumerate(caches) if lc.kind == "recurrent"}
        gdn = 0
        if linear:
            attn += H * heads * hd  # the gated attention's q_proj also yields the output gate
            hk, hv = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
            dk, dv = int(c.linear_key_head_dim), int(c.linear_value_head_dim)
            gdn = H * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * H + 3 * hv * dk * dv
        layers = int(c.num_hidden_layers)
        per_layer = [(gdn if i in linear else attn) + _mlp_params(c, moe, i) for i in range(layers)]
        common = dict(num_layers=layers, head_params=int(c.vocab_size) * H, attn_dim=heads * hd, windows=windows)
        if len(set(per_layer)) == 1:
            return cls(layer_params=per_layer[0], **common)
        return cls(layer_params=sum(per_layer) // layers, body_params=sum(per_layer), **common)

    @property
    def body(self) -> int:
        """Matmul weights a token goes through in all decoder layers."""
        return self.num_layers * self.layer_params if self.body_params is None else self.body_params

    @property
    def params(self) -> int:
        """Matmul weights in all: ``P`` of ``6 * P`` per token."""
        return self.body + self.head_params

    def train_flops(self, seq_lens: list[int], head_tokens: int | None = None) -> float:
        """Forward + backward model FLOPs of sequences of ``seq_lens`` real tokens (see the module
        docstring): ``6 * (layers * P_layer * tokens + P_head * head_tokens) + 6 * layers * d_attn * sum(len^2)``."""
        tokens = sum(seq_lens)
        head = tokens if head_tokens is None else head_tokens
        dense = 6.0 * (self.body * tokens + self.head_params * head)
        windows = self.windows or (None,) * self.num_layers
        pairs = sum(_visible_pairs(n, w) for w in windows for n in seq_lens)  # L^2/2 per full layer and sequence
        return dense + 12.0 * self.attn_dim * pairs

    def forward_flops(self, seq_lens: list[int], head_tokens: int | None = None) -> float:
        """Forward-only model FLOPs (a third of :meth:`train_flops`): the experience forwards."""
        return self.train_flops(seq_lens, head_tokens) / 3.0


def _visible_pairs(n: int, window: int | None) -> float:
    """The (query, key) pairs a causal layer computes over a sequence of ``n`` tokens, by the
    convention's ``n^2 / 2``; within a window W: ``W^2 / 2 + (n - W) W`` once ``n > W``."""
    if window is None or n <= window:
        return n * n / 2.0
    return window * window / 2.0 + (n - window) * window


def _mlp_params(c, moe: families.MoEShape | None, layer: int) -> int:
    """Matmul weights a token goes through in decoder layer ``layer``'s MLP: the dense gated MLP of
    ``intermediate_size``, or an MoE layer's active experts."""
    if moe is None or layer in moe.dense_layers:
        return 3 * int(c.hidden_size) * int(c.intermediate_size)
    return active_expert_params(moe, int(c.hidden_size))


def active_expert_params(moe: families.MoEShape, hidden: int) -> int:
    """Matmul weights one token goes through in an MoE layer's MLP: the router (``E x H``), its
    ``top_k`` routed experts and the shared experts (a gated MLP each: ``3 x H x I``; and their gate)."""
    routed = moe.top_k * 3 * hidden * moe.expert_intermediate
    gate = hidden if moe.shared_expert_gate else 0  # the shared experts' sigmoid gate (1 x H)
    return moe.experts * hidden + routed + moe.shared_experts * 3 * hidden * moe.shared_intermediate + gate


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak."""
    return flops / seconds / peak_flops_per_s if seconds > 0 and peak_flops_per_s > 0 else 0.0


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, *, n: int = 8192, iters: int = 20) -> float:
    """The measured matmul ceiling of ``device`` in FLOP/s: the best of ``iters`` timed ``n x n x n``
    matmuls in ``dtype`` (after a warm-up), ``2 n^3`` FLOPs each. On CUDA this is the dense bf16
    throughput MFU is measured against (below the datasheet figure: clocks, power)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    cuda = device.type == "cuda"
    best = float("inf")
    for i in range(iters + 2):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            torch.mm(a, b)
            seconds = time.perf_counter() - t0
        if i >= 2:  # warm-up
            best = min(best, seconds)
    return 2.0 * n**3 / best
