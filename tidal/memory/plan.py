"""The memory plan: each phase's peak device memory, predicted before any model loads, and the
``auto`` settings chosen so that the run fits (issue 21).

Pure arithmetic on plain numbers (no torch device): :class:`ModelShape` from a Hugging Face config,
:class:`PlanInputs` from a run's config plus the device's and the host's memory, :func:`plan_memory`
-> :class:`MemoryPlan` (per phase, what is on the device and how many bytes; on the host, what is
pinned or parked), :func:`apply_plan` -> :class:`MemorySettings` (the values the run uses), or a
:class:`~tidal.config_base.ConfigError` that says what to change when nothing fits. A setting the
user gave is kept and only checked; only ``auto`` settings are chosen:
``train.micro_batch_tokens``, ``train.forward_micro_batch_tokens``, ``model.gradient_checkpointing``,
``strategy.offload_optimizer`` and ``engine.sleep_level``, the cheapest combination that fits
(:func:`_candidates`). The engine's KV cache is the engine's to size
(:mod:`tidal.engine.sizing`, at each wake-up, from the memory available then); the plan predicts
it with the same rule and checks that it holds a sequence.

Every byte count is per rank. Where a figure comes from:

- Weights, gradients, optimizer state: counted from the shape, as the strategy backend says it
  keeps them (:func:`tidal.strategy.memory_layout`: ``FSDP2Layout`` next to the FSDP2 strategy,
  ``DeepSpeedLayout`` next to DeepSpeed's; e.g. FSDP2's fp32 masters sharded, its unsharded fp32
  gradients while micro-batches accumulate, AdamW's moments on the device or, with
  ``strategy.offload_optimizer``, in pinned host memory streamed through two staging chunks). The
  engine's memory is the engine's to describe (:mod:`tidal.engine.sizing`: its layout, its
  activations, its KV rule). Every setting is read from the run's config sections themselves
  (:class:`PlanInputs`): the plan keeps no copy of their defaults.
- Activations (:func:`layer_saved_bytes`): what autograd keeps for the backward of one Hugging Face
  Qwen2/Llama decoder layer in bf16, per token. Micro-batches are packed (no padding: every token
  counted is a real one, and a budget holds whole sequences, so it is at least the longest,
  ``data.max_prompt_len + rollout.max_new_tokens``); the packed attention (flash varlen on CUDA)
  keeps what causal SDPA over an unpadded row keeps, which is what is counted tensor by tensor with
  ``torch.autograd.graph.saved_tensors_hooks`` (``tests/unit/test_memory_activations.py`` checks the
  formula against that count, eager and compiled):

  * eager: ``16H + 4Q + 4K + 8I + 4n + 8`` (H hidden, Q = heads x head_dim, K = kv heads x head_dim,
    I intermediate, n heads): each RMSNorm keeps its fp32 input, its bf16 normalised input and its
    output (8H + 4); attention keeps rotated q and k, v, its output and the fp32 log-sum-exp; the
    MLP keeps gate, SiLU(gate), up and their product (8I).
  * ``torch.compile`` (``strategy.compile``): ``8H + 4Q + 4K + 6I + 4n + 8``: the partitioner keeps
    the matmul inputs and outputs and recomputes the elementwise ops.
  * gradient checkpointing keeps each layer's input (``2H``) and recomputes one layer at a time;
    checkpointed layers run eager (:func:`tidal.strategy.fsdp2.compile_layers`: a compiled
    layer's saved tensors escape the checkpoint), so their terms are the eager ones.
  * the backward adds the larger of the LM head's (first: its fp32 ``[V, H]`` weight-gradient
    accumulator and bf16 result, ``6VH``, and chunk buffers of ``logprob_chunk_tokens`` rows of
    logits, ``27cV`` eager, ``4cV`` compiled) and a layer's (later: ``3I`` per token, with
    checkpointing plus the recomputed layer): measured eager on CPU; the compiled LM head keeps
    only a chunk of bf16 logits and their gradient (its softmax passes are fused).
  * LoRA: each adapted projection keeps its ``[T, r]`` down-projection; eager, the frozen norms
    keep no bf16 input (``-4H``).

  On one H200 this reproduces the measured peaks of three runs within 2% (0.5B at 24k and 49k
  tokens, 1.5B at 49k, all compiled). Bounded rather than predicted (labelled so in the table):
  the flash backward's own buffers (:func:`attention_workspace_bytes`) and the allocator's slack
  at a micro-batch's peak (one of its largest blocks, not allocated). Not counted: anything of a
  model type other than Qwen2/Llama (Qwen3's q/k norms are estimated). Token counts
  are upper bounds: every response at ``rollout.max_new_tokens`` (natural lengths pack more
  sequences into a budget, never more tokens).
- Fixed costs outside PyTorch's allocator: the CUDA context (measured when the plan is made) plus
  :data:`NON_TORCH_RESERVE` (NCCL buffers, library workspaces, compiled kernels); the native
  engine's KV cache, which on CUDA lives outside the allocator (driver virtual memory). Its size
  is the engine's rule (:func:`tidal.engine.sizing.kv_budget_bytes`: ``engine.kv_cache_memory_fraction``
  of the memory available when it wakes up for a rollout, i.e. with the steady state's resident
  weights and optimizer state), or ``engine.kv_cache_max_tokens``; the plan applies that rule to
  its predicted free memory and never changes the engine's settings. A model with sliding-window
  layers beside full ones splits that budget between two block pools by the engine's rule
  (:func:`tidal.engine.sizing.split_kv_pools`): its window layers hold at most a window's blocks
  per sequence, sized for sequences of ``data.max_prompt_len + rollout.max_new_tokens``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tidal import families
from tidal.config_base import ConfigError
from tidal.distributed.topology import Topology
from tidal.engine import sizing as engine_sizing
from tidal.strategy import memory_layout

if TYPE_CHECKING:
    from tidal.engine.config import EngineConfig
    from tidal.memory.config import MemoryConfig
    from tidal.models.config import ModelConfig
    from tidal.strategy.config import StrategyConfig
    from tidal.trainer.config import RolloutConfig, TrainConfig

GiB = 2**30
MiB = 2**20

# Device memory outside PyTorch's allocator that the plan cannot measure when it is made: NCCL
# communicators (created at the first collective), cuBLAS/cuDNN workspaces, compiled kernels' code.
NON_TORCH_RESERVE = 512 * MiB
NCCL_RESERVE = 512 * MiB  # more of it with several ranks
# The CUDA context when the device is not measured (memory.device_memory_gib given).
ASSUMED_CUDA_CONTEXT = 768 * MiB
# Below this many tokens a training micro-batch pays more in per-micro-batch costs (FSDP2 gathers
# every layer once per micro-batch; smaller matmuls) than gradient checkpointing costs in recompute:
# the plan turns checkpointing on rather than go below it.
MIN_EFFICIENT_MICRO_BATCH_TOKENS = 16384
# The most tokens an ``auto`` no-grad forward micro-batch gets (larger ones gain little).
MAX_FORWARD_MICRO_BATCH_TOKENS = 65536
# Host memory of one training process besides what the plan lists (Python, torch, CUDA libraries).
HOST_PROCESS_BYTES = 3 * GiB
# Rough full tensors in flight while weights are gathered for the engine (two 256 MiB buckets).
WEIGHT_SYNC_BYTES = 512 * MiB
# Per token of the loss computation (fp32 [B, T] ratios, masks, advantages kept for backward).
LOSS_BYTES_PER_TOKEN = 64

_LORA_TARGETS_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_LORA_TARGETS_MLP = ("gate_proj", "up_proj", "down_proj")


def gib(nbytes: float) -> float:
    return nbytes / GiB


# ---- the model -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers of a decoder-only transformer (a Hugging Face config's text part) that memory
    depends on. ``qkv_bias``: q/k/v projections have biases (Qwen2). ``qk_norm``: RMSNorm on each
    head's q and k (Qwen3). ``layer_caches``: what each layer keeps in the engine, as its family
    declares (:mod:`tidal.families`); empty: full KV in every layer (a shape written by hand).
    ``linear_attention``: a hybrid model's Gated DeltaNet layers (Qwen3.5) as ``(layers, key heads,
    value heads, key head dim, value head dim, conv kernel)``, the other layers being gated full
    attention (``q_proj`` also yields the output gate); empty: every layer is attention."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_norm: str = ""  # the family's: "" none, "head" per head, "projection" over the q and k projections
    model_type: str = ""
    vision: bool = False  # a vision-language model (its vision tower is not counted)
    layer_caches: tuple[families.LayerCache, ...] = ()
    lora_targets: tuple[str, ...] = families.DEFAULT_LORA_TARGETS  # the family's default model.lora.target_modules
    moe: families.MoEShape | None = None  # the family's MoE MLP (None: dense); sparse layers hold every expert
    linear_attention: tuple[int, ...] = ()
    norms_per_layer: int = 2  # RMSNorms on a layer's residual path (the family's; Gemma 3's sandwich: 4)

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShape":
        """From a ``transformers`` config object or its ``config.json`` as a dict (a vision-language
        config's ``text_config`` is used for the decoder)."""
        top = families.namespace(config)
        text = families.text_config(config)
        family = families.find_family(config)  # None: a model only engine.backend: hf runs (full KV counted)
        model_type = str(getattr(text, "model_type", "") or getattr(top, "model_type", ""))
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        tied = getattr(top, "tie_word_embeddings", None)
        if tied is None:
            tied = getattr(text, "tie_word_embeddings", False)
        moe = family.moe(text) if family else None
        return cls(
            layers=int(text.num_hidden_layers), hidden=hidden, heads=heads,
            kv_heads=families.kv_heads_of(text), head_dim=families.head_dim_of(text),
            intermediate=_dense_intermediate(text, moe), vocab=int(text.vocab_size), tied_embeddings=bool(tied),
            qkv_bias=model_type.startswith("qwen2") or bool(getattr(text, "attention_bias", False)),
            qk_norm=family.qk_norm if family else ("head" if model_type.startswith("qwen3") else ""), model_type=model_type,
            vision=getattr(top, "vision_config", None) is not None,
            layer_caches=tuple(family.layer_caches(text)) if family else (),
            lora_targets=family.lora_targets if family else families.DEFAULT_LORA_TARGETS,
            moe=moe,
            linear_attention=_linear_attention_shape(text),
            norms_per_layer=family.norms_per_layer if family else 2,
        )

    def caches(self) -> list[families.LayerCache]:
        """Each layer's engine cache: the family's, or full KV of this shape's heads in every layer."""
        if self.layer_caches:
            return list(self.layer_caches)
        return [families.LayerCache(kind="full_kv", kv_heads=self.kv_heads, head_dim=self.head_dim)] * self.layers

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one layer, by its HF module name."""
        H, q, kv, I = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        gate = 2 if self.linear_attention else 1  # Qwen3.5's gated attention: [query | gate] per head
        return {"q_proj": (H, gate * q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def linear_attention_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a Gated DeltaNet layer (empty without)."""
        if not self.linear_attention:
            return {}
        _, hk, hv, dk, dv, _ = self.linear_attention
        H, I = self.hidden, self.intermediate
        return {"in_proj_qkv": (H, 2 * hk * dk + hv * dv), "in_proj_z": (H, hv * dv), "in_proj_b": (H, hv),
                "in_proj_a": (H, hv), "out_proj": (hv * dv, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def linear_layers(self) -> frozenset[int]:
        """The indices of the Gated DeltaNet layers: the family's ``recurrent`` caches (a shape written
        by hand without caches: the first ``linear_attention[0]`` layers)."""
        if self.layer_caches:
            return frozenset(i for i, lc in enumerate(self.layer_caches) if lc.kind == "recurrent")
        return frozenset(range(self.linear_attention[0] if self.linear_attention else 0))

    def _attention_params(self) -> int:
        """A full-attention layer's projections (a gated attention's ``q_proj`` also yields the
        gate), their biases and the layer's norms."""
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        qk = self.q_dim + self.kv_dim if self.qk_norm == "projection" else 2 * self.head_dim
        norms = self.norms_per_layer * self.hidden + (qk if self.qk_norm or self.linear_attention else 0)
        return sum(i * o for n, (i, o) in self.linear_shapes().items() if n not in _LORA_TARGETS_MLP) + bias + norms

    def _linear_attention_params(self) -> int:
        """A Gated DeltaNet layer's projections, short conv, decay parameters and the layer's norms."""
        _, hk, hv, dk, dv, conv = self.linear_attention
        extra = (2 * hk * dk + hv * dv) * conv + 2 * hv + dv + 2 * self.hidden  # conv, A_log, dt_bias, norms
        return sum(i * o for n, (i, o) in self.linear_attention_shapes().items() if n not in _LORA_TARGETS_MLP) + extra

    def _expert_params(self, experts: int) -> int:
        """``experts`` routed experts of an MoE layer (gated MLPs of ``expert_intermediate``)."""
        return experts * 3 * self.hidden * self.moe.expert_intermediate

    def _sparse_mlp_params(self, *, active: bool) -> int:
        """An MoE layer's MLP: router, routed experts (all, or the ``top_k`` a token uses) and shared experts."""
        m = self.moe
        shared = m.shared_experts * 3 * self.hidden * m.shared_intermediate + (self.hidden if m.shared_expert_gate else 0)
        return m.experts * self.hidden + self._expert_params(m.top_k if active else m.experts) + shared

    def _layer_list(self, *, active: bool) -> list[int]:
        """Each decoder layer's parameters: its token mixer (full attention, or Gated DeltaNet in a
        hybrid's linear layers) plus its MLP (dense, or the MoE: all experts, or the active ones)."""
        linear = self.linear_layers()
        out = []
        for i in range(self.layers):
            mixer = self._linear_attention_params() if i in linear else self._attention_params()
            dense = self.moe is None or i in self.moe.dense_layers
            out.append(mixer + (3 * self.hidden * self.intermediate if dense else self._sparse_mlp_params(active=active)))
        return out

    def layer_params(self) -> int:
        """The largest decoder layer's parameters (an MoE layer holds all its experts): what a
        sharded backend gathers at once."""
        return max(self._layer_list(active=False))

    def body_params(self) -> int:
        """Every decoder layer's parameters."""
        return sum(self._layer_list(active=False))

    def embedding_params(self) -> int:
        """Input embedding plus the LM head (a second matrix unless tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def params(self) -> int:
        """Every parameter (an MoE: all experts), what weights, gradients and optimizer state hold."""
        return self.body_params() + self.embedding_params() + self.hidden

    def active_params(self) -> int:
        """The parameters one token goes through (an MoE layer: its router, ``top_k`` routed and its
        shared experts); ``params()`` for a dense model."""
        return sum(self._layer_list(active=True)) + self.embedding_params() + self.hidden

    def mlp_width(self) -> int:
        """The MLP's intermediate activations per token, averaged over the layers (an MoE layer's
        ``top_k`` routed rows of ``expert_intermediate``, and its shared experts)."""
        if self.moe is None:
            return self.intermediate
        m = self.moe
        sparse = m.top_k * m.expert_intermediate + m.shared_experts * m.shared_intermediate
        n_dense = len(m.dense_layers)
        return (n_dense * self.intermediate + (self.layers - n_dense) * sparse) // self.layers

    def critic_params(self) -> int:
        """A value model on this body: no LM head, a scalar head."""
        return self.body_params() + self.vocab * self.hidden + 2 * self.hidden + 1

    def kv_cache_bytes_per_token(self, tp_size: int = 1) -> int:
        """bf16 K and V of every layer that keeps KV, the KV heads split over the engine's TP group
        (:func:`tidal.families.kv_bytes_per_token`)."""
        return families.kv_bytes_per_token(self.caches(), 2, tp_size)

    def state_bytes_per_sequence(self, tp_size: int = 1) -> int:
        """Recurrent-state bytes of one sequence on one engine TP rank (linear-attention layers;
        0 without: :func:`tidal.families.state_bytes_per_sequence`)."""
        return families.state_bytes_per_sequence(self.caches(), tp_size)


def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...], expert_targets: tuple[str, ...] = ()) -> int:
    """Adapter parameters: ``rank x (in + out)`` per targeted projection per layer (an MoE's MLP
    projections exist in its dense layers only); per expert of every sparse layer for the stacked
    experts named in ``expert_targets`` (``model.lora.target_parameters``: ``...gate_up_proj``,
    ``...down_proj``) or in ``targets`` (PEFT matches a ``target_modules`` name against the stacked
    experts' parameters too where the family says so (``MoEShape.peft_maps_expert_names``): the
    default targets adapt every expert's ``down_proj``); a shared expert's projections as
    ``nn.Linear`` modules."""
    if rank <= 0:
        return 0
    mlp = _LORA_TARGETS_MLP

    def cost(shapes: dict[str, tuple[int, int]], keep) -> int:
        return sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets and keep(name))

    attn = cost(shape.linear_shapes(), lambda n: n not in mlp)
    gdn = cost(shape.linear_attention_shapes(), lambda n: n not in mlp)
    dense = cost(shape.linear_shapes(), lambda n: n in mlp)
    linear = shape.linear_layers()
    mixers = sum(gdn if i in linear else attn for i in range(shape.layers))
    if shape.moe is None:
        return mixers + shape.layers * dense
    H, Ie, m = shape.hidden, shape.moe.expert_intermediate, shape.moe
    per_expert = {"gate_up_proj": rank * (H + 2 * Ie), "down_proj": rank * (Ie + H)}
    by_name = m.peft_maps_expert_names  # PEFT maps target_modules names onto the stacked experts
    experts = m.experts * sum(n for p, n in per_expert.items()
                              if (by_name and p in targets) or any(t.endswith(p) for t in expert_targets))
    Is = m.shared_intermediate  # a shared expert is a gated MLP of nn.Linear projections (Qwen3.5-MoE)
    shared = m.shared_experts * cost({"gate_proj": (H, Is), "up_proj": (H, Is), "down_proj": (Is, H)}, lambda n: True)
    sparse = shape.layers - len(m.dense_layers)
    return mixers + len(m.dense_layers) * dense + sparse * (experts + shared)


def _dense_intermediate(text: Any, moe: families.MoEShape | None) -> int:
    """:attr:`ModelShape.intermediate`: the dense MLP's ``intermediate_size``; 0 for an MoE whose
    every layer is sparse and whose config has none (Qwen3.5-MoE)."""
    if moe is not None and not moe.dense_layers and getattr(text, "intermediate_size", None) is None:
        return 0
    return int(text.intermediate_size)


def _linear_attention_shape(text: Any) -> tuple[int, ...]:
    """:attr:`ModelShape.linear_attention` of a text config (empty unless it has linear-attention layers)."""
    linear = sum(kind == "linear_attention" for kind in getattr(text, "layer_types", None) or ())
    if not linear:
        return ()
    return (linear, int(text.linear_num_key_heads), int(text.linear_num_value_heads), int(text.linear_key_head_dim),
            int(text.linear_value_head_dim), int(text.linear_conv_kernel_dim))


# ---- activations (bytes per token unless named otherwise) ----------------------------------------------
def layer_saved_bytes(shape: ModelShape, *, compiled: bool, lora_rank: int = 0, lora_targets: int = 0) -> int:
    """Bytes per token one decoder layer keeps for its backward (bf16 compute; packed rows: causal
    attention within each sequence, no mask, K/V not repeated to the query heads). ``lora_targets``
    projections with rank-``lora_rank`` adapters each keep their ``[T, r]`` bf16 down-projection,
    and the frozen base's norms need not keep their normalised input (eager)."""
    H, q, kv, I, n = shape.hidden, shape.q_dim, shape.kv_dim, shape.mlp_width(), shape.heads
    if compiled:
        b = 8 * H + 4 * q + 4 * kv + 6 * I + 4 * n + 8
    else:
        b = 16 * H + 4 * q + 4 * kv + 8 * I + 4 * n + 8
    if shape.qk_norm:  # estimated (not calibrated): normalised copies of q and k, fp32 in eager
        b += (2 if compiled else 6) * (q + kv) + 4 * (shape.heads + shape.kv_heads)
    # norms beyond the pre-attention and pre-MLP ones (Gemma 3's post-attention and post-MLP norms):
    # each keeps its bf16 input and fp32 row statistics (its fp32 copy too in eager); measured on an
    # H200, Gemma 3 1B at 49,152 tokens ran 7.4% over a plan without them (issue 50)
    b += (shape.norms_per_layer - 2) * ((2 if compiled else 6) * H + 4)
    if lora_rank and not compiled:  # frozen norm weights: their bf16 inputs are not kept (estimated kept when compiled)
        b -= 4 * H
    if shape.moe is not None:
        # fp32 router logits, the routed rows' bf16 inputs and outputs, and the routed outputs
        # before their routing weights scale them (kept for that product's backward): without
        # the last, Qwen3-MoE (64 experts, top-8, hidden 1024) ran 10% over the plan on an H200
        b += 4 * shape.moe.experts + 6 * shape.moe.top_k * H
    return b + 2 * lora_rank * lora_targets


def train_activation_bytes(
    shape: ModelShape, tokens: int, *, response_tokens: int, compiled: bool, checkpointing: bool,
    lora_rank: int = 0, lora_targets: int = 0, lm_head: bool = True,
) -> int:
    """Bytes a training micro-batch of ``tokens`` (``response_tokens`` of them through the LM head)
    keeps for its backward when the backward starts: every layer's saved tensors (with
    checkpointing: every layer's input), the final norm and the loss terms per token, and per
    response token the LM head's input and fp32 statistics."""
    if checkpointing:
        body = shape.layers * 2 * shape.hidden
    else:
        body = shape.layers * layer_saved_bytes(shape, compiled=compiled, lora_rank=lora_rank, lora_targets=lora_targets)
    per_token = body + 6 * shape.hidden + 4 + LOSS_BYTES_PER_TOKEN
    head = (2 * shape.hidden + 72) * response_tokens if lm_head else 0
    return tokens * per_token + head


def layer_backward_bytes(shape: ModelShape, tokens: int, *, compiled: bool, checkpointing: bool,
                         lora_rank: int = 0, lora_targets: int = 0) -> int:
    """What a layer's backward adds on top of the saved tensors: its gradient buffers (``3I`` per
    token, measured eager on CPU), with checkpointing also the recomputed layer's saved tensors."""
    recomputed = layer_saved_bytes(shape, compiled=compiled, lora_rank=lora_rank, lora_targets=lora_targets)
    return tokens * (3 * shape.mlp_width() + (recomputed if checkpointing else 0))


def attention_workspace_bytes(shape: ModelShape, tokens: int) -> int:
    """What the CUDA flash attention backward allocates for itself beside its outputs: an fp32
    accumulator of the query gradient (``4Q`` per token) and fp32 row statistics (``4n`` per
    token, twice). Not seen on CPU (its math kernel has none); counted from the kernel's buffers."""
    return tokens * (4 * shape.q_dim + 8 * shape.heads)


def lm_head_train_bytes(shape: ModelShape, chunk_rows: int, *, compiled: bool) -> int:
    """The LM head's backward on top of the saved activations: the fp32 ``[V, H]`` weight-gradient
    accumulator and its bf16 result, and one chunk of logits and their gradients (fused when compiled)."""
    return 6 * shape.vocab * shape.hidden + (4 if compiled else 27) * chunk_rows * shape.vocab


def forward_activation_bytes(shape: ModelShape, tokens: int, *, response_tokens: int, chunk_rows: int, compiled: bool,
                             lm_head: bool = True) -> int:
    """Peak of a no-grad forward of ``tokens``, the larger of: inside a layer (the MLP's gate, up
    and product, the residual stream and norms, ``6I + 8H`` per token, and 64 bytes of token ids,
    positions and masks), and at the LM head (the final hidden states, the response rows' inputs
    and one chunk of logits: ``2cV`` compiled, ``14cV`` eager). Measured eager on CPU."""
    routed = 4 * shape.moe.top_k * shape.hidden if shape.moe is not None else 0  # an MoE's routed rows (estimated)
    body = tokens * (6 * shape.mlp_width() + 8 * shape.hidden + 64 + routed)
    if not lm_head:
        return body
    head = tokens * (2 * shape.hidden + 64) + (2 * shape.hidden + 16) * response_tokens + (2 if compiled else 14) * chunk_rows * shape.vocab
    return max(body, head)


# ---- inputs ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One device: ``total`` bytes, ``context`` bytes this process uses outside PyTorch's allocator
    (its CUDA context), and ``others`` bytes held by other processes on the device (a crashed run's
    process, another job), as measured (``others_source``: how, see
    :func:`tidal.memory.probe.device_memory`). Neither is the plan's to free: both count against the
    budget, and the plan names the others' share for what it is."""

    name: str
    total: int
    context: int
    others: int = 0
    others_source: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostMemory:
    """Host memory the plan may count on: ``total`` bytes and where the figure comes from."""

    total: int
    source: str


def given(value):
    """A setting the user gave, or None where it is ``auto`` (the plan decides it)."""
    return None if value == "auto" else value


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything :func:`plan_memory` needs: the model's shape, the run's config sections as written
    (``auto`` where the plan decides; every other value, default or not, is the section's own: the
    plan keeps no copy of a config default), and the machine (see :func:`inputs_from_config`).
    ``needs_*``: the Algorithm's; ``compiled``: ``strategy.compile`` resolved for the device;
    ``kv_outside_allocator``: the engine's KV cache lives outside PyTorch's allocator;
    ``teacher``: a local distillation teacher's shape."""

    shape: ModelShape
    train: TrainConfig
    model: ModelConfig
    strategy: StrategyConfig
    engine: EngineConfig
    rollout: RolloutConfig
    memory: MemoryConfig
    max_prompt_len: int  # data.max_prompt_len
    world_size: int = 1
    local_world_size: int = 1
    num_nodes: int = 1
    needs_reference: bool = False
    needs_critic: bool = False
    compiled: bool = True
    kv_outside_allocator: bool = True
    teacher: ModelShape | None = None
    device: DeviceMemory
    host: HostMemory

    # the settings the plan decides: None where they are ``auto``
    @property
    def micro_batch_tokens(self) -> int | None:
        return given(self.train.micro_batch_tokens)

    @property
    def forward_micro_batch_tokens(self) -> int | None:
        return given(self.train.forward_micro_batch_tokens)

    @property
    def gradient_checkpointing(self) -> bool | None:
        return given(self.model.gradient_checkpointing)

    @property
    def offload_optimizer(self) -> bool | None:
        return given(self.strategy.offload_optimizer)

    @property
    def sleep_level(self) -> int | None:
        return given(self.engine.sleep_level)

    # derived numbers
    @property
    def shard_size(self) -> int:
        """Ranks that shard each model (``strategy.shard`` on ``num_nodes`` nodes of equal size); the
        model's bytes per rank are divided by this, not by the world, under hybrid sharding (FSDP2's
        HSDP holds exactly that; DeepSpeed's hierarchical partitioning keeps masters and moments
        partitioned over the world, so for it this over-estimates them)."""
        topology = Topology.regular(self.num_nodes, max(1, self.world_size // self.num_nodes))
        return topology.shard_size(self.strategy.shard_setting())

    @property
    def max_len(self) -> int:
        return self.max_prompt_len + self.rollout.max_new_tokens

    @property
    def sequences_per_rank(self) -> int:
        """Sequences one rank rolls out and trains on per step."""
        return max(1, self.rollout.prompts_per_step * self.rollout.n_samples // self.world_size)

    @property
    def sequences_per_engine(self) -> int:
        """Sequences one engine generates per rollout (a TP group's ranks gather their prompts)."""
        return self.sequences_per_rank * self.engine.tp_size

    @property
    def decode_batch(self) -> int:
        """The largest decode batch: every sequence of the rollout (one wave) unless ``engine.max_num_seqs`` caps it."""
        cap = given(self.engine.max_num_seqs)
        return min(self.sequences_per_engine, cap or self.sequences_per_engine)

    @property
    def lora_rank(self) -> int:
        return self.model.lora.rank

    @property
    def lora_targets(self) -> tuple[str, ...]:
        given = self.model.lora.target_modules
        return tuple(given) if given is not None else self.shape.lora_targets

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def budget(self) -> int:
        return int(self.device.total * self.memory.device_fraction)


def inputs_from_config(cfg, hf_config, *, world_size: int, local_world_size: int, num_nodes: int = 1, device: DeviceMemory, host: HostMemory,
                       needs_reference: bool, needs_critic: bool, compiled: bool, kv_outside_allocator: bool,
                       teacher_hf_config: Any = None) -> PlanInputs:
    """:class:`PlanInputs` of a :class:`~tidal.config.TidalConfig` (its sections as they are).
    ``hf_config``: the actor's Hugging Face config (or its ``config.json`` as a dict);
    ``teacher_hf_config``: the local distillation teacher's (``model.teacher.path``), None without one."""
    return PlanInputs(
        shape=ModelShape.from_hf_config(hf_config), train=cfg.train, model=cfg.model, strategy=cfg.strategy, engine=cfg.engine,
        rollout=cfg.rollout, memory=cfg.memory, max_prompt_len=cfg.data.max_prompt_len, world_size=world_size,
        local_world_size=local_world_size, num_nodes=num_nodes, needs_reference=needs_reference, needs_critic=needs_critic, compiled=compiled,
        kv_outside_allocator=kv_outside_allocator,
        teacher=ModelShape.from_hf_config(teacher_hf_config) if teacher_hf_config is not None else None, device=device, host=host,
    )


# ---- the plan -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """``nbytes`` of one thing; ``allocated`` False for memory outside PyTorch's allocator."""

    label: str
    nbytes: int
    allocated: bool = True


@dataclasses.dataclass(frozen=True)
class PhasePeak:
    name: str
    parts: tuple[Part, ...]

    @property
    def total(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` would read at this phase's peak."""
        return sum(p.nbytes for p in self.parts if p.allocated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """The settings one plan is computed for."""

    micro_batch_tokens: int
    forward_micro_batch_tokens: int
    gradient_checkpointing: bool
    offload_optimizer: bool
    sleep_level: int  # engine.sleep_level: 2 parks the engine's weights on the host outside rollouts


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Predicted peaks of each phase for the chosen settings. ``problems`` is empty when it fits;
    each problem is (config key to change, what to do). ``tried``: when nothing fits, how many
    combinations of the ``auto`` settings were planned (this one is the smallest of them)."""

    inputs: PlanInputs
    choice: Choice
    phases: tuple[PhasePeak, ...]
    host_parts: tuple[Part, ...]
    host_setup_bytes: int
    problems: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    tried: int = 0

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak(self) -> PhasePeak:
        return max(self.phases, key=lambda p: p.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def predicted_peak_allocated_gib(self) -> float:
        """The largest ``torch.cuda.max_memory_allocated`` of any phase, in GiB (for benchmarks)."""
        return gib(max(p.allocated for p in self.phases))

    @property
    def host_bytes(self) -> int:
        """Host memory of all local ranks in the steady state."""
        return self.inputs.local_world_size * sum(p.nbytes for p in self.host_parts)

    def chosen(self) -> dict[str, Any]:
        """The keys the plan decided (they were ``auto``), with their values."""
        inp, c = self.inputs, self.choice
        out: dict[str, Any] = {}
        if inp.micro_batch_tokens is None:
            out["train.micro_batch_tokens"] = c.micro_batch_tokens
        if inp.forward_micro_batch_tokens is None:
            out["train.forward_micro_batch_tokens"] = c.forward_micro_batch_tokens
        if inp.gradient_checkpointing is None:
            out["model.gradient_checkpointing"] = c.gradient_checkpointing
        if inp.offload_optimizer is None:
            out["strategy.offload_optimizer"] = c.offload_optimizer
        if inp.sleep_level is None:
            out["engine.sleep_level"] = c.sleep_level
        return out

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the engine's KV cache is predicted to hold in the steady state (0: not the native engine)."""
        return _kv_tokens(self.inputs, _sizes(self.inputs, self.choice.offload_optimizer)) if _engine(self.inputs).own_kv_rule else 0

    def table(self) -> str:
        return format_plan(self)


# ---- what is where, per phase -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Bytes of the resident pieces for one choice."""

    actor_weights: int
    actor_grads: int
    actor_grads_accumulating: int  # while several micro-batches accumulate (before the last one's reduction)
    actor_optim_device: int
    actor_optim_host: int
    optimizer_staging: int
    host_label: str
    critic_weights: int
    critic_grads: int
    critic_optim_device: int
    critic_optim_host: int
    reference: int
    teacher: int
    engine_weights: int
    overhead: int
    others: int  # held by other processes on the device


def _trainable_params(inp: PlanInputs) -> int:
    return lora_params(inp.shape, inp.lora_rank, inp.lora_targets, tuple(inp.model.lora.target_parameters)) if inp.lora else inp.shape.params()


def _sizes(inp: PlanInputs, offload: bool) -> _Sizes:
    """The resident pieces, each as its owner describes it: the trained and frozen models' bytes
    by the strategy backend's layout (:func:`tidal.strategy.memory_layout`), the engine's weights."""
    layout = memory_layout(inp.strategy.backend)
    shape, world = inp.shape, inp.shard_size
    n_all, n_train = shape.params(), _trainable_params(inp)
    actor = layout.trained(inp.strategy, stored=n_all + (n_train if inp.lora else 0), trainable=n_train, world=world, offload=offload)
    n_critic = shape.critic_params() if inp.needs_critic else 0
    critic = layout.trained(inp.strategy, stored=n_critic, trainable=n_critic, world=world, offload=offload)
    return _Sizes(
        actor_weights=actor.weights, actor_grads=actor.grads, actor_grads_accumulating=actor.grads_accumulating,
        actor_optim_device=actor.optimizer_device, actor_optim_host=actor.optimizer_host, optimizer_staging=actor.optimizer_staging,
        host_label=actor.host_label,
        critic_weights=critic.weights, critic_grads=critic.grads, critic_optim_device=critic.optimizer_device,
        critic_optim_host=critic.optimizer_host,
        reference=layout.frozen(inp.strategy, params=n_all, world=world) if inp.needs_reference and not inp.lora else 0,
        teacher=layout.frozen(inp.strategy, params=inp.teacher.params(), world=world) if inp.teacher is not None else 0,
        engine_weights=2 * n_all // inp.engine.tp_size,
        overhead=inp.device.context + NON_TORCH_RESERVE + (NCCL_RESERVE if inp.world_size > 1 else 0),
        others=inp.device.others,
    )


def _working(inp: PlanInputs, shape: ModelShape, *, backward: bool) -> int:
    """The backend's unsharded (gathered) parameters during a pass of a model of ``shape``."""
    return memory_layout(inp.strategy.backend).working(inp.strategy, layer_params=shape.layer_params(),
                                                       root_params=shape.embedding_params(), backward=backward)


def _kv_tokens(inp: PlanInputs, sz: _Sizes) -> int:
    """The tokens of the engine's KV cache at a steady-state rollout: ``engine.kv_cache_max_tokens``
    when set, else the engine's own rule (:func:`tidal.engine.sizing.kv_budget_bytes`) applied to the
    memory available when it wakes up: the device less what is outside the allocator and what stays
    allocated (the resident weights and optimizer state, the engine's weights), in whole blocks."""
    return _kv_pools(inp, sz)[0] * inp.engine.block_size


def _kv_block_bytes(inp: PlanInputs) -> tuple[int, int]:
    """Bytes of one block of the engine's full-layer pool and of its window-layer pool (0: none)."""
    caches, bs, tp = inp.shape.caches(), inp.engine.block_size, inp.engine.tp_size
    if not families.has_window_pool(caches):
        return bs * families.kv_bytes_per_token(caches, 2, tp), 0
    return (bs * families.kv_bytes_per_token([c for c in caches if c.kind == "full_kv"], 2, tp),
            bs * families.kv_bytes_per_token([c for c in caches if c.kind == "window_kv"], 2, tp))


def _kv_pools(inp: PlanInputs, sz: _Sizes) -> tuple[int, int]:
    """The engine's (full-layer, window-layer) KV blocks at a steady-state rollout, by its own rules
    (:func:`tidal.engine.sizing.split_kv_pools`: the window layers' pool sized for sequences of
    ``max_len``, which the trainer hands the engine too); window blocks 0 without a window pool."""
    bs, mnbt = inp.engine.block_size, inp.engine.max_num_batched_tokens
    window = families.pool_window(inp.shape.caches())
    if inp.engine.kv_cache_max_tokens:
        full = inp.engine.kv_cache_max_tokens // bs
        return full, 0 if window is None else engine_sizing.window_pool_blocks(
            full, block_size=bs, window=window, seq_len=inp.max_len, max_num_batched_tokens=mnbt)
    available = max(0, _wake_available(inp, sz) - _state_pool_bytes(inp, sz))
    full_b, window_b = _kv_block_bytes(inp)
    return engine_sizing.split_kv_pools(lambda n, w: n * full_b + w * window_b, engine_sizing.kv_budget_bytes(inp.engine, available),
                                        block_size=bs, window=window, seq_len=inp.max_len, max_num_batched_tokens=mnbt)


def _wake_available(inp: PlanInputs, sz: _Sizes) -> int:
    """Device memory available when the engine wakes up: the device less what is outside the
    allocator and what stays allocated (the resident weights and optimizer state, the engine's weights)."""
    resident = sum(p.nbytes for p in _resident(inp, sz, actor=not inp.strategy.offload_actor_during_rollout) if p.allocated)
    return max(0, inp.device.total - sz.overhead - sz.others - resident - sz.engine_weights)


def _state_pool_bytes(inp: PlanInputs, sz: _Sizes) -> int:
    """The recurrent-state pool of a hybrid model, allocated at wake-up before the KV cache
    (:func:`tidal.engine.sizing.state_slots`); 0 for a model without linear-attention layers."""
    per_slot = inp.shape.state_bytes_per_sequence(inp.engine.tp_size)
    if not per_slot:
        return 0
    return engine_sizing.state_slots(inp.engine, per_slot, _wake_available(inp, sz), inp.decode_batch) * per_slot


def _resident(inp: PlanInputs, sz: _Sizes, *, actor: bool = True, critic: bool = True) -> list[Part]:
    parts = [Part("CUDA context and library reserve", sz.overhead, allocated=False),
             Part("held by other processes", sz.others, allocated=False)]
    if actor:
        parts.append(Part("actor weights", sz.actor_weights))
    if sz.actor_optim_device:
        parts.append(Part("actor optimizer state", sz.actor_optim_device))
    if sz.critic_weights and critic and not inp.strategy.offload_critic:
        parts.append(Part("critic weights", sz.critic_weights))
    if sz.critic_optim_device:
        parts.append(Part("critic optimizer state", sz.critic_optim_device))
    if sz.reference and not inp.strategy.offload_reference:
        parts.append(Part("reference weights", sz.reference))
    if sz.teacher and not inp.strategy.offload_teacher:
        parts.append(Part("teacher weights", sz.teacher))
    return [p for p in parts if p.nbytes]


def _engine(inp: PlanInputs) -> engine_sizing.EngineLayout:
    layout = engine_sizing.engine_layout(inp.engine, kv_fixed=inp.kv_outside_allocator)
    if inp.shape.state_bytes_per_sequence():  # a hybrid model decodes eagerly (no state slots in the graphs)
        layout = dataclasses.replace(layout, graphs=False, graphs_survive_sleep=False)
    return layout


def _decode_bytes(inp: PlanInputs, batch: int) -> int:
    sh = inp.shape
    return engine_sizing.decode_bytes(hidden=sh.hidden, intermediate=sh.mlp_width(), vocab=sh.vocab, max_num_seqs=batch,
                                      tp_size=inp.engine.tp_size)

def _graph_pool(inp: PlanInputs) -> Part:
    """Activations of the largest decode batch replayed from a CUDA graph (``engine.cuda_graph_max_batch``)."""
    batch = min(inp.decode_batch, inp.engine.cuda_graph_max_batch)
    return Part("CUDA graph pool", _decode_bytes(inp, batch), allocated=False)


def _engine_between_rollouts(inp: PlanInputs, sz: _Sizes, c: Choice) -> list[Part]:
    """What the engine keeps on the device outside rollouts: level 0 everything; level 1 its
    weights (and its CUDA graphs' pool where the graphs survive); level 2 nothing."""
    if c.sleep_level >= 2:
        return []
    parts = [Part("engine weights", sz.engine_weights)]
    if c.sleep_level == 0:
        parts += _cache_parts(inp, sz)
    if _engine(inp).graphs_survive_sleep or (c.sleep_level == 0 and inp.engine.cuda_graphs):
        parts.append(_graph_pool(inp))
    return parts


def _cache_parts(inp: PlanInputs, sz: _Sizes) -> list[Part]:
    """The engine's KV cache and, for a hybrid model, its recurrent-state pool."""
    full, window = _kv_pools(inp, sz)
    full_b, window_b = _kv_block_bytes(inp)
    bs = inp.engine.block_size
    label = f"engine KV cache ({full * bs} tokens)" if not window_b else (
        f"engine KV cache ({full * bs} tokens; sliding-window layers {window * bs})")
    parts = [Part(label, full * full_b + window * window_b, allocated=not inp.kv_outside_allocator)]
    states = _state_pool_bytes(inp, sz) if _engine(inp).own_kv_rule else 0
    if states:
        per_slot = inp.shape.state_bytes_per_sequence(inp.engine.tp_size)
        parts.append(Part(f"engine recurrent state ({states // per_slot} slots)", states))
    return parts


def _response_tokens(inp: PlanInputs, tokens: int) -> int:
    return tokens * inp.rollout.max_new_tokens // inp.max_len


def _lora_targets(inp: PlanInputs) -> int:
    return len(set(inp.lora_targets) & set(inp.shape.linear_shapes() | inp.shape.linear_attention_shapes())) if inp.lora else 0


def _phase_rollout(inp: PlanInputs, sz: _Sizes, c: Choice) -> PhasePeak:
    prefill = engine_sizing.prefill_bytes(hidden=inp.shape.hidden, intermediate=inp.shape.mlp_width(),
                                          max_num_batched_tokens=inp.engine.max_num_batched_tokens, tp_size=inp.engine.tp_size)
    graphs = _engine(inp).graphs
    # decode batches above the graphs' largest run eagerly, their activations in the allocator
    eager = inp.decode_batch if not graphs or inp.decode_batch > inp.engine.cuda_graph_max_batch else 0
    decode = _decode_bytes(inp, eager)
    parts = _resident(inp, sz, actor=not inp.strategy.offload_actor_during_rollout) + [
        Part("engine weights", sz.engine_weights), *_cache_parts(inp, sz),
        Part("engine activations", max(prefill, decode)),
    ]
    if graphs:
        parts.append(_graph_pool(inp))
    return PhasePeak("rollout", tuple(parts))


def _phase_experience(inp: PlanInputs, sz: _Sizes, c: Choice) -> PhasePeak:
    """The no-grad forwards of the experience, one model at a time (actor, reference, critic,
    teacher): the largest of them, with that model's weights when it is reloaded for it."""
    tokens = c.forward_micro_batch_tokens
    response = _response_tokens(inp, tokens)
    runs = [("actor", inp.shape, 0)]  # (who, shape, weights brought in for it)
    if sz.reference:
        runs.append(("reference", inp.shape, sz.reference if inp.strategy.offload_reference else 0))
    if sz.critic_weights:
        runs.append(("critic", inp.shape, sz.critic_weights if inp.strategy.offload_critic else 0))
    if sz.teacher:
        runs.append(("teacher", inp.teacher, sz.teacher if inp.strategy.offload_teacher else 0))

    def cost(run):
        _, shape, weights = run
        fwd = forward_activation_bytes(shape, tokens, response_tokens=response, chunk_rows=min(inp.model.logprob_chunk_tokens, response),
                                       compiled=inp.compiled)
        return [Part(f"{run[0]} weights (reloaded)", weights), Part(f"{run[0]} forward ({tokens} tokens)", fwd),
                Part("unsharded layers", _working(inp, shape, backward=False))]

    largest = max((cost(r) for r in runs), key=lambda parts: sum(p.nbytes for p in parts))
    parts = _resident(inp, sz) + _engine_between_rollouts(inp, sz, c) + [p for p in largest if p.nbytes]
    return PhasePeak("experience", tuple(parts))


def _layers_compiled(inp: PlanInputs, c: Choice) -> bool:
    """Whether the trained models' decoder layers run compiled: not under gradient checkpointing
    (:func:`tidal.strategy.fsdp2.compile_layers` leaves checkpointed layers eager); the LM head's
    logprob passes compile either way (``inp.compiled``)."""
    return inp.compiled and not c.gradient_checkpointing


def _micro_batches(inp: PlanInputs, tokens: int) -> int:
    """Training micro-batches per optimizer step (at least; rows do not pack perfectly)."""
    per_mini = max(1, inp.sequences_per_rank // inp.train.mini_batches) * inp.max_len
    return -(-per_mini // max(1, tokens))


def _phase_update(inp: PlanInputs, sz: _Sizes, c: Choice, tokens: int | None = None) -> PhasePeak:
    """A training micro-batch in its backward: the saved activations plus the larger of the LM
    head's backward (first) and a layer's (later). With several micro-batches per step the
    gradients of the earlier ones are there; with one, they appear as the activations are freed,
    layer by layer, so the peak is the larger of the two."""
    tokens = c.micro_batch_tokens if tokens is None else tokens
    response = _response_tokens(inp, tokens)
    kw = dict(compiled=_layers_compiled(inp, c), checkpointing=c.gradient_checkpointing, lora_rank=inp.lora_rank,
              lora_targets=_lora_targets(inp))
    act = train_activation_bytes(inp.shape, tokens, response_tokens=response, **kw)
    head = lm_head_train_bytes(inp.shape, min(inp.model.logprob_chunk_tokens, response), compiled=inp.compiled)
    layer = layer_backward_bytes(inp.shape, tokens, **kw)
    parts = _resident(inp, sz) + _engine_between_rollouts(inp, sz, c)
    parts.append(Part("unsharded layers and gradients", _working(inp, inp.shape, backward=True)))
    several = _micro_batches(inp, tokens) > 1
    grads = sz.actor_grads_accumulating if several else sz.actor_grads
    if several or grads >= act + max(head, layer):
        parts.append(Part("actor gradients" + (" (accumulating)" if grads != sz.actor_grads else ""), grads))
    if several or grads < act + max(head, layer):
        parts.append(Part(f"activations ({tokens} tokens{', checkpointed' if c.gradient_checkpointing else ''})", act))
        parts.append(Part("LM head backward", head) if head >= layer else Part("a layer's backward", layer))
    if layer >= head:
        parts.append(Part("attention backward workspace", attention_workspace_bytes(inp.shape, tokens)))
    parts.append(_allocator_slack(inp, tokens))
    return PhasePeak("update", tuple(p for p in parts if p.nbytes))


def _allocator_slack(inp: PlanInputs, tokens: int) -> Part:
    """Reserved beyond allocated at a training micro-batch's peak (not predicted: bounded). The
    caching allocator serves each large request from a cached block at least as large, so a freed
    block that is too small for the next request stays reserved: bounded here by one of the largest
    blocks a micro-batch allocates (the MLP's ``[T, I]`` bf16 intermediate, or a chunk of fp32
    logits). Not allocated: it counts against the budget, not in ``max_memory_allocated``."""
    chunk = min(inp.model.logprob_chunk_tokens, _response_tokens(inp, tokens))
    return Part("allocator slack (one largest block, bound)", max(2 * tokens * inp.shape.mlp_width(), 4 * chunk * inp.shape.vocab),
                allocated=False)


def _phase_optimizer_step(inp: PlanInputs, sz: _Sizes, c: Choice) -> PhasePeak:
    parts = _resident(inp, sz) + _engine_between_rollouts(inp, sz, c) + [Part("actor gradients", sz.actor_grads)]
    if sz.optimizer_staging:
        parts.append(Part("optimizer state staging (streamed)", sz.optimizer_staging))
    return PhasePeak("optimizer step", tuple(parts))


def _phase_critic_update(inp: PlanInputs, sz: _Sizes, c: Choice) -> PhasePeak:
    tokens = c.micro_batch_tokens
    kw = dict(compiled=_layers_compiled(inp, c), checkpointing=c.gradient_checkpointing)
    act = train_activation_bytes(inp.shape, tokens, response_tokens=0, lm_head=False, **kw) + layer_backward_bytes(inp.shape, tokens, **kw)
    parts = _resident(inp, sz) + _engine_between_rollouts(inp, sz, c)
    if inp.strategy.offload_critic:
        parts.append(Part("critic weights (reloaded)", sz.critic_weights))
    parts += [Part("critic gradients", sz.critic_grads), Part(f"critic activations ({tokens} tokens)", act),
              Part("unsharded layers and gradients", _working(inp, inp.shape, backward=True))]
    return PhasePeak("critic update", tuple(parts))


def _phase_weight_sync(inp: PlanInputs, sz: _Sizes, c: Choice) -> PhasePeak:
    # a LoRA target merged in fp32 (the largest one): its base and the merged result
    merge = max((8 * i * o for n, (i, o) in (inp.shape.linear_shapes() | inp.shape.linear_attention_shapes()).items()
                 if n in inp.lora_targets), default=0) if inp.lora else 0
    engine = _engine_between_rollouts(inp, sz, c) if c.sleep_level < 2 else [Part("engine weights", sz.engine_weights)]
    parts = _resident(inp, sz) + engine + [Part("gathered weights in flight", WEIGHT_SYNC_BYTES + merge)]
    return PhasePeak("weight sync", tuple(parts))


def _phases(inp: PlanInputs, c: Choice) -> tuple[PhasePeak, ...]:
    sz = _sizes(inp, c.offload_optimizer)
    phases = [_phase_rollout(inp, sz, c), _phase_experience(inp, sz, c), _phase_update(inp, sz, c), _phase_optimizer_step(inp, sz, c)]
    if inp.needs_critic:
        phases.append(_phase_critic_update(inp, sz, c))
    phases.append(_phase_weight_sync(inp, sz, c))
    return tuple(phases)


def _host_parts(inp: PlanInputs, c: Choice) -> tuple[list[Part], int]:
    """(steady-state host memory of one rank, its peak while loading a model at setup)."""
    sz = _sizes(inp, c.offload_optimizer)
    parts = [Part("process (Python, torch, CUDA libraries)", HOST_PROCESS_BYTES)]
    if sz.actor_optim_host:
        parts.append(Part(f"actor optimizer state ({sz.host_label})", sz.actor_optim_host))
    if sz.critic_optim_host:
        parts.append(Part("critic optimizer state (pinned)", sz.critic_optim_host))
    if c.sleep_level == 2 and _engine(inp).parks_weights:
        parts.append(Part("engine weights while asleep (pinned)", sz.engine_weights))
    if sz.reference and inp.strategy.offload_reference:
        parts.append(Part("parked reference weights (pinned)", sz.reference))
    if sz.teacher and inp.strategy.offload_teacher:
        parts.append(Part("parked teacher weights (pinned)", sz.teacher))
    if inp.strategy.offload_actor_during_rollout:
        parts.append(Part("actor weights during rollout", sz.actor_weights))
    if inp.strategy.offload_critic:
        parts.append(Part("critic weights between uses", sz.critic_weights))
    # from_pretrained materialises a whole model in fp32 on the host before it is sharded
    setup = HOST_PROCESS_BYTES + 4 * max(inp.shape.params(), inp.teacher.params() if inp.teacher is not None else 0)
    return parts, setup


# ---- choosing -----------------------------------------------------------------------------------------------
def _fits(phase: PhasePeak, budget: int) -> bool:
    return phase.total <= budget


def _largest_fitting(lo: int, hi: int, fits) -> int:
    """The largest t in [lo, hi] with ``fits(t)`` (monotone), or 0 when even ``lo`` does not fit."""
    if hi < lo or not fits(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _round_tokens(t: int, floor: int) -> int:
    """Round a chosen token budget down to a multiple of 1024 (never below ``floor``)."""
    return max(floor, t // 1024 * 1024) if t >= 4096 else t


def _train_cap(inp: PlanInputs) -> int:
    """The most tokens a training micro-batch can hold: a rank's mini-batch, or max_seqs full rows."""
    per_mini = max(1, inp.sequences_per_rank // inp.train.mini_batches) * inp.max_len
    return max(inp.max_len, min(per_mini, inp.train.micro_batch_max_seqs * inp.max_len))


def _forward_cap(inp: PlanInputs) -> int:
    rows = min(inp.sequences_per_rank, inp.train.forward_micro_batch_max_seqs)
    return max(inp.max_len, min(MAX_FORWARD_MICRO_BATCH_TOKENS, rows * inp.max_len))


def _base_choice(inp: PlanInputs, offload: bool, gc: bool, sleep_level: int) -> Choice:
    return Choice(
        micro_batch_tokens=inp.micro_batch_tokens or inp.max_len,
        forward_micro_batch_tokens=inp.forward_micro_batch_tokens or inp.max_len,
        gradient_checkpointing=gc, offload_optimizer=offload, sleep_level=sleep_level,
    )


def _choose_tokens(inp: PlanInputs, c: Choice) -> Choice:
    """Fill in the ``auto`` token budgets: the largest that fit (whole rows: at least one full one)."""
    budget = inp.budget
    sz = _sizes(inp, c.offload_optimizer)
    if inp.micro_batch_tokens is None:
        best = _largest_fitting(inp.max_len, _train_cap(inp), lambda t: _fits(_phase_update(inp, sz, c, t), budget))
        c = dataclasses.replace(c, micro_batch_tokens=_round_tokens(best, inp.max_len) if best else inp.max_len)
    if inp.forward_micro_batch_tokens is None:
        def fwd_fits(t):
            return _fits(_phase_experience(inp, sz, dataclasses.replace(c, forward_micro_batch_tokens=t)), budget)
        best = _largest_fitting(inp.max_len, _forward_cap(inp), fwd_fits)
        c = dataclasses.replace(c, forward_micro_batch_tokens=_round_tokens(best, inp.max_len) if best else inp.max_len)
    return c


def _problems(inp: PlanInputs, c: Choice, phases: tuple[PhasePeak, ...], host_parts: list[Part], host_setup: int) -> list[tuple[str, str]]:
    out = []
    budget = inp.budget
    for ph in phases:
        if ph.total > budget:
            out.append(_phase_problem(inp, c, ph))
    kv_tokens = _kv_tokens(inp, _sizes(inp, c.offload_optimizer))
    if _engine(inp).own_kv_rule and kv_tokens < inp.max_len:
        key = "engine.kv_cache_max_tokens" if inp.engine.kv_cache_max_tokens else "engine.kv_cache_memory_fraction"
        out.append((key, f"the engine's KV cache would hold {kv_tokens} tokens, less than one sequence of "
                    f"{inp.max_len} (data.max_prompt_len + rollout.max_new_tokens); raise {key}, free device memory "
                    "during rollouts (strategy.offload_optimizer=true, strategy.offload_actor_during_rollout=true) or "
                    "shorten the sequences"))
    host_budget = int(inp.host.total * inp.memory.host_fraction)
    steady = inp.local_world_size * sum(p.nbytes for p in host_parts)
    setup = inp.local_world_size * host_setup
    for what, need in (("host memory in the steady state", steady), ("host memory while loading the model", setup)):
        if need > host_budget:
            out.append(("memory.host_memory_gib", (
                f"{what}: {gib(need):.1f} GiB for {inp.local_world_size} rank(s) on this host, more than "
                f"{inp.memory.host_fraction:.0%} of {gib(inp.host.total):.1f} GiB ({inp.host.source}). Keep less on the host "
                "(strategy.offload_optimizer=false, engine.sleep_level=1, strategy.offload_reference=false) or, where "
                "the machine has more memory than detected (memory that grows as it is used), set memory.host_memory_gib")))
    return out


def _phase_problem(inp: PlanInputs, c: Choice, ph: PhasePeak) -> tuple[str, str]:
    """(the first setting to change, the problem and every change that would lower this phase)."""
    over = (f"the {ph.name} phase needs {gib(ph.total):.1f} GiB, over the budget of {gib(inp.budget):.1f} GiB "
            f"({inp.memory.device_fraction:.0%} of {gib(inp.device.total):.1f} GiB, memory.device_fraction)")
    training = ph.name in ("update", "critic update")
    hints: list[tuple[str, str]] = []
    if training and inp.micro_batch_tokens is not None and inp.micro_batch_tokens > inp.max_len:
        hints.append(("train.micro_batch_tokens", f"lower train.micro_batch_tokens ({inp.micro_batch_tokens}) or set it to auto"))
    if ph.name == "experience" and inp.forward_micro_batch_tokens is not None and inp.forward_micro_batch_tokens > inp.max_len:
        hints.append(("train.forward_micro_batch_tokens",
                      f"lower train.forward_micro_batch_tokens ({inp.forward_micro_batch_tokens}) or set it to auto"))
    if training and not c.gradient_checkpointing:
        hints.append(("model.gradient_checkpointing", "set model.gradient_checkpointing=true (or auto)"))
    if not c.offload_optimizer and ph.name != "weight sync":
        hints.append(("strategy.offload_optimizer", "set strategy.offload_optimizer=true (or auto): the optimizer state waits in host memory"))
    if c.sleep_level < 2 and ph.name not in ("rollout", "weight sync"):
        hints.append(("engine.sleep_level", "set engine.sleep_level=2 (or auto): the engine's weights wait on the host outside rollouts"))
    if ph.name == "rollout":
        hints.append(("engine.kv_cache_memory_fraction", "lower engine.kv_cache_memory_fraction or set engine.kv_cache_max_tokens, "
                      "or strategy.offload_actor_during_rollout=true"))
    one = training and c.micro_batch_tokens <= inp.max_len
    hints.append(("rollout.max_new_tokens", (f"a packed micro-batch of one longest sequence ({inp.max_len} tokens) already "
                  "does not fit: " if one else "") + f"shorten sequences (data.max_prompt_len + rollout.max_new_tokens = "
                  f"{inp.max_len} tokens; a micro-batch holds whole sequences), train with LoRA (model.lora.rank) or use "
                  "more GPUs (weights and optimizer state shard over them)"))
    return hints[0][0], over + ": " + "; ".join(h for _, h in hints)


# What ``engine.sleep_level: auto`` chooses from: 1 frees the KV cache between rollouts at no cost
# worth counting (it is sized again at each wake-up); 2 also parks the engine's weights on the host.
# 0 (everything stays) is never chosen: it holds the KV cache through training for no gain in speed.
AUTO_SLEEP_LEVELS = (1, 2)


def _transfer_bytes(inp: PlanInputs, offload: bool, sleep_level: int) -> int:
    """Host-device traffic per step that a choice adds, which orders the choices that move state to
    the host: level-2 sleep copies the engine's weights to the host and back (and the native
    engine recaptures its CUDA graphs at the next rollout); optimizer offload streams the state
    through the device in and out at every optimizer step (``train.epochs x train.mini_batches``;
    DeepSpeed's ZeRO-Offload moves less but runs the step on the CPU). For a full fine-tune the
    weights' two bytes per parameter move less than the state's; for LoRA (a few MB of state) the
    other way round."""
    sz = _sizes(inp, offload)
    steps = inp.train.epochs * inp.train.mini_batches
    return (2 * sz.engine_weights if sleep_level >= 2 else 0) + 2 * steps * (sz.actor_optim_host + sz.critic_optim_host)


def _candidates(inp: PlanInputs) -> list[tuple[bool, bool, int]]:
    """(offload_optimizer, gradient_checkpointing, sleep_level) in order of cost: first without
    gradient checkpointing (a third more compute for every token), then with it; within each, the
    least host-device traffic per step first (:func:`_transfer_bytes`: nothing moved, then level-2
    sleep or optimizer offload, whichever moves less, then both). Settings the user gave take only
    their value."""
    offloads = [inp.offload_optimizer] if inp.offload_optimizer is not None else [False, True]
    gcs = [inp.gradient_checkpointing] if inp.gradient_checkpointing is not None else [False, True]
    levels = [inp.sleep_level] if inp.sleep_level is not None else list(AUTO_SLEEP_LEVELS)
    out = [(o, g, lv) for g in gcs for o in offloads for lv in levels]
    return sorted(out, key=lambda cand: (cand[1], _transfer_bytes(inp, cand[0], cand[2]), cand[0], cand[2]))


def plan_memory(inp: PlanInputs) -> MemoryPlan:
    """The memory plan for ``inp``: among the allowed choices of optimizer offload, gradient
    checkpointing and engine sleep level, the first (in :func:`_candidates` order: the cheapest)
    that fits with a training micro-batch of at least :data:`MIN_EFFICIENT_MICRO_BATCH_TOKENS` (or
    the whole mini-batch, if smaller); else the fitting one with the largest micro-batch; else the
    one that misses by the least (its ``problems`` say what to change, ``tried`` what was tried).
    Never raises for a plan that does not fit."""
    plans = []
    for offload, gc, level in _candidates(inp):
        plans.append(_plan_for(inp, _choose_tokens(inp, _base_choice(inp, offload, gc, level))))
    enough = min(MIN_EFFICIENT_MICRO_BATCH_TOKENS, _train_cap(inp))
    for p in plans:
        if p.fits and p.choice.micro_batch_tokens >= enough:
            return p
    fitting = [p for p in plans if p.fits]
    if fitting:
        return max(fitting, key=lambda p: p.choice.micro_batch_tokens)
    return dataclasses.replace(min(plans, key=lambda p: p.peak_bytes), tried=len(plans))


def _plan_for(inp: PlanInputs, c: Choice) -> MemoryPlan:
    phases = _phases(inp, c)
    host_parts, host_setup = _host_parts(inp, c)
    notes = []
    notes += [n for n in (_engine(inp).note, memory_layout(inp.strategy.backend).note) if n]
    if inp.shape.vision:
        notes.append("vision-language model: the vision tower's weights and activations are not counted")
    if inp.device.others:
        notes.append(f"{gib(inp.device.others):.1f} GiB of this device are held by other processes "
                     f"({inp.device.others_source or 'measured'}); the plan counts them as taken: end those processes "
                     "(a crashed run's process still holding the device?) to give the run that memory")
    kv_tokens = _kv_tokens(inp, _sizes(inp, c.offload_optimizer))
    if _engine(inp).own_kv_rule and inp.max_len <= kv_tokens < inp.decode_batch * inp.max_len:
        notes.append(f"the KV cache ({kv_tokens} tokens) holds {kv_tokens // inp.max_len} of the rollout's {inp.decode_batch} "
                     "sequences at full length: long rollouts run in more than one wave")
    return MemoryPlan(inputs=inp, choice=c, phases=phases, host_parts=tuple(host_parts), host_setup_bytes=host_setup,
                      problems=tuple(_problems(inp, c, phases, host_parts, host_setup)), notes=tuple(notes))


# ---- the settings a run uses ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The values a run uses for the settings the plan decides: the user's explicit value, or the
    plan's choice where it was ``auto``. Components read these, never ``auto`` from the config.
    ``plan``: None when no plan was made (a CPU run without ``memory.device_memory_gib``, the
    reward-model job)."""

    micro_batch_tokens: int
    forward_micro_batch_tokens: int
    gradient_checkpointing: bool
    offload_optimizer: bool
    sleep_level: int
    plan: MemoryPlan | None = None

    # Config sections as a component should read them, ``auto`` replaced by these values: copies for
    # components that take a section (the user's config objects are never changed).
    def train_config(self, cfg):
        """``cfg`` (``train.*``) with the micro-batch token budgets this run uses."""
        return dataclasses.replace(cfg, micro_batch_tokens=self.micro_batch_tokens, forward_micro_batch_tokens=self.forward_micro_batch_tokens)

    def model_config(self, cfg):
        """``cfg`` (``model.*``) with the gradient checkpointing this run uses."""
        return dataclasses.replace(cfg, gradient_checkpointing=self.gradient_checkpointing)

    def strategy_config(self, cfg):
        """``cfg`` (``strategy.*``) with the optimizer offload this run uses."""
        return dataclasses.replace(cfg, offload_optimizer=self.offload_optimizer)

    def engine_config(self, cfg):
        """``cfg`` (``engine.*``) with the sleep level this run uses."""
        return dataclasses.replace(cfg, sleep_level=self.sleep_level)

    def run_config(self, cfg, *, engine: bool = True):
        """The root config ``cfg`` with the four sections above resolved: what every component
        built after the plan is handed (the user's ``cfg`` stays as written, ``auto`` included).
        ``engine=False``: a job without a rollout engine (the reward model's), whose ``engine``
        section stays as written (the job refuses it set away from its defaults)."""
        return dataclasses.replace(cfg, train=self.train_config(cfg.train), model=self.model_config(cfg.model),
                                   strategy=self.strategy_config(cfg.strategy),
                                   engine=self.engine_config(cfg.engine) if engine else cfg.engine)


# Values of ``auto`` settings in a run without a plan (a CPU run without memory.device_memory_gib,
# the reward-model job): the fixed defaults these keys had before the plan.
UNPLANNED_DEFAULTS = dict(micro_batch_tokens=16384, forward_micro_batch_tokens=65536, gradient_checkpointing=False, offload_optimizer=False,
                          sleep_level=1)


def settings_without_plan(cfg, *, longest: int = 0) -> MemorySettings:
    """Settings of a run that makes no plan: explicit values as given, ``auto`` ones at
    :data:`UNPLANNED_DEFAULTS`, the token budgets raised to ``longest`` (the longest sequence, which
    a packed micro-batch must hold) where that is more."""
    given = dict(micro_batch_tokens=cfg.train.micro_batch_tokens, forward_micro_batch_tokens=cfg.train.forward_micro_batch_tokens,
                 gradient_checkpointing=cfg.model.gradient_checkpointing, offload_optimizer=cfg.strategy.offload_optimizer,
                 sleep_level=cfg.engine.sleep_level)
    values = {k: UNPLANNED_DEFAULTS[k] if v == "auto" else v for k, v in given.items()}
    for k in ("micro_batch_tokens", "forward_micro_batch_tokens"):
        if given[k] == "auto":
            values[k] = max(values[k], longest)
    return MemorySettings(**values)


def apply_plan(plan: MemoryPlan) -> MemorySettings:
    """The settings of ``plan``, or a ConfigError (key: the first setting to change) whose message
    lists every problem and the plan's table, when it does not fit."""
    if not plan.fits:
        key = plan.problems[0][0]
        lines = [_no_fit_summary(plan) + f" {len(plan.problems)} problem(s):"]
        lines += [f"  - {k}: {msg}" for k, msg in plan.problems]
        raise ConfigError(key, "\n".join(lines) + "\n" + format_plan(plan))
    c = plan.choice
    return MemorySettings(micro_batch_tokens=c.micro_batch_tokens, forward_micro_batch_tokens=c.forward_micro_batch_tokens,
                          gradient_checkpointing=c.gradient_checkpointing, offload_optimizer=c.offload_optimizer,
                          sleep_level=c.sleep_level, plan=plan)


def _no_fit_summary(plan: MemoryPlan) -> str:
    """The first line of the error of a plan that does not fit: what was tried, which combination
    is shown (the smallest), and the device memory held by other processes."""
    chosen = plan.chosen()
    if chosen:
        smallest = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in chosen.items())
        text = (f"the run does not fit in memory: none of the {plan.tried} combination(s) of the settings left at auto fits "
                f"(engine.sleep_level 1 or 2, strategy.offload_optimizer, model.gradient_checkpointing, token budgets down "
                f"to one longest sequence, as each is left at auto); the smallest ({smallest}) is shown below.")
    else:
        text = "the run does not fit in memory with the settings given (none is left at auto)."
    others = plan.inputs.device.others
    if others:
        text += (f" {gib(others):.1f} GiB of the device are held by other processes ({plan.inputs.device.others_source or 'measured'}):"
                 " end them to give the run that memory.")
    return text


# ---- the table --------------------------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan, *, parts_shown: int = 4) -> str:
    """A readable table: the device and budget, the settings (chosen or given), each phase's peak
    with its largest parts, and the host memory."""
    inp, c = plan.inputs, plan.choice
    shape = inp.shape
    lines = [
        f"memory plan: {inp.device.name}, {gib(inp.device.total):.1f} GiB, budget {inp.memory.device_fraction:.0%} = {gib(inp.budget):.1f} GiB; "
        f"model {shape.params() / 1e9:.2f}B parameters ({shape.model_type or 'decoder'}, {shape.layers} layers, hidden {shape.hidden}"
        + (f"; MoE {shape.moe.experts} experts, top-{shape.moe.top_k}, {shape.active_params() / 1e9:.2f}B active" if shape.moe else "") + ")"
        + (f", LoRA rank {inp.lora_rank} ({_trainable_params(inp) / 1e6:.1f}M trained)" if inp.lora else "")
        + f"; {inp.world_size} rank(s)" + (f" on {inp.num_nodes} nodes" if inp.num_nodes > 1 else "")
        + f", {inp.strategy.backend}" + (f" sharded over {inp.shard_size} (hybrid)" if inp.shard_size < inp.world_size else ""),
    ]
    chosen = plan.chosen()
    settings = [
        ("train.micro_batch_tokens", c.micro_batch_tokens), ("train.forward_micro_batch_tokens", c.forward_micro_batch_tokens),
        ("model.gradient_checkpointing", c.gradient_checkpointing), ("strategy.offload_optimizer", c.offload_optimizer),
        ("engine.sleep_level", c.sleep_level),
    ]
    if plan.kv_cache_tokens:
        source = "engine.kv_cache_max_tokens" if inp.engine.kv_cache_max_tokens else f"{inp.engine.kv_cache_memory_fraction:g} of the memory available"
        settings.append(("engine KV cache", f"{plan.kv_cache_tokens} tokens ({source})"))
    lines.append("  settings: " + ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}{' (auto)' if k in chosen else ''}"
                                             for k, v in settings))
    width = max(len(p.name) for p in plan.phases)
    lines.append(f"  {'phase':<{width}}  peak GiB  allocated  largest parts (GiB)")
    for ph in plan.phases:
        top = sorted(ph.parts, key=lambda p: -p.nbytes)[:parts_shown]
        flag = "  OVER BUDGET" if ph.total > inp.budget else ""
        lines.append(f"  {ph.name:<{width}}  {gib(ph.total):8.1f}  {gib(ph.allocated):9.1f}  "
                     + ", ".join(f"{p.label} {gib(p.nbytes):.1f}" for p in top) + flag)
    host_total = sum(p.nbytes for p in plan.host_parts)
    lines.append(f"  host: {gib(plan.host_bytes):.1f} GiB steady ({inp.local_world_size} rank(s) x {gib(host_total):.1f}: "
                 + ", ".join(f"{p.label} {gib(p.nbytes):.1f}" for p in plan.host_parts)
                 + f"), {gib(inp.local_world_size * plan.host_setup_bytes):.1f} GiB while loading; "
                 f"budget {inp.memory.host_fraction:.0%} of {gib(inp.host.total):.1f} GiB ({inp.host.source})")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
