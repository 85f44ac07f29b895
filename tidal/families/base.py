"""What a model family is, for every part of Tidal that reads a model's shape (torch-free).

A family is declared once, in its own module ``tidal/families/<name>.py`` as ``FAMILY = Family(...)``
(the package finds it there: :func:`tidal.families.families`). The native engine's caches and
scheduler, packed training, weight sync, LoRA defaults, the memory plan, the bench bounds and
``tidal check`` ask the family and never switch on a model name.

Configs are read as Hugging Face config objects or as their ``config.json`` dicts (:func:`text_config`):
nothing here imports torch or transformers.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from typing import Any, Callable

CACHE_KINDS = ("full_kv", "window_kv", "recurrent")
# the attention and MLP projections of a dense decoder (Qwen2/Qwen3/Llama/Gemma 3/OLMo 3 names)
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PACKED_KERNELS = ("attention", "sliding_window", "linear_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerCache:
    """What one decoder layer keeps per sequence in the native engine.

    ``kind``: ``full_kv`` (paged K and V of every token), ``window_kv`` (paged K and V of the last
    ``window`` tokens only) or ``recurrent`` (fixed-size state tensors, whatever the length).
    ``kv_heads``/``head_dim``: the KV kinds' K (and V) heads and their size, before TP.
    ``window``: ``window_kv`` only: a query at position ``p`` attends to the keys at positions
    ``p - window < j <= p`` (``window`` tokens, itself included), which is what HF's
    ``sliding_window`` means (``transformers.masking_utils.sliding_window_overlay``:
    ``kv_idx > q_idx - sliding_window``).
    ``state_shapes``/``state_dtype``: ``recurrent`` only: the per-sequence state tensors (e.g. the
    short-conv state and the delta-rule state), full size before TP, and their dtype name
    (``"float32"``; ``""``: the engine's dtype).
    """

    kind: str
    kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtype: str = ""

    def __post_init__(self):
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"LayerCache.kind={self.kind!r}: choose one of {list(CACHE_KINDS)}")
        kv = self.kind != "recurrent"
        if kv and (self.kv_heads < 1 or self.head_dim < 1):
            raise ValueError(f"LayerCache({self.kind}): kv_heads and head_dim must be >= 1")
        if (self.kind == "window_kv") != (self.window is not None):
            raise ValueError(f"LayerCache({self.kind}): window is set for window_kv layers and only for them")
        if self.window is not None and self.window < 1:
            raise ValueError(f"LayerCache.window={self.window}: must be >= 1")
        if (self.kind == "recurrent") != bool(self.state_shapes):
            raise ValueError(f"LayerCache({self.kind}): state_shapes are given for recurrent layers and only for them")

    @property
    def has_kv(self) -> bool:
        return self.kind != "recurrent"

    def first_key(self, q_pos: int) -> int:
        """The first key position a query at ``q_pos`` attends to (0 unless the layer has a window)."""
        return 0 if self.window is None else max(0, q_pos - self.window + 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEShape:
    """The mixture-of-experts MLP of a family (None for dense models). ``experts`` routed experts of
    ``expert_intermediate`` each, ``top_k`` of them per token; ``shared_experts`` always-on experts
    of ``shared_intermediate`` each; ``router``: how the top-k weights are made (e.g.
    ``"softmax_topk"``, ``"softmax_topk_renorm"``). ``dense_layers``: the decoder layers that keep a
    dense MLP of the config's ``intermediate_size`` instead (every other layer is sparse).
    ``shared_expert_gate``: a per-token sigmoid gate (weight ``[1, H]``) scales the shared experts'
    output (Qwen3.5-MoE). ``peft_maps_expert_names``: PEFT maps ``target_modules`` names of expert
    projections (``down_proj``) onto the stacked experts for this model type (its
    ``transformers`` 4 -> 5 conversion table has it: Qwen3-MoE, OLMoE); False for Qwen3.5-MoE,
    whose ``target_modules`` then match only ``nn.Linear`` modules (the shared expert's), the routed
    experts taking ``target_parameters``."""

    experts: int
    top_k: int
    expert_intermediate: int
    shared_experts: int = 0
    shared_intermediate: int = 0
    router: str = "softmax_topk"
    dense_layers: tuple[int, ...] = ()
    shared_expert_gate: bool = False
    peft_maps_expert_names: bool = True

    def sparse_layers(self, num_layers: int) -> list[int]:
        """The indices of the decoder layers whose MLP is this MoE."""
        return [i for i in range(num_layers) if i not in self.dense_layers]


def full_attention_caches(text: Any) -> list[LayerCache]:
    """Every layer keeps full paged KV (dense Qwen2/Qwen3/Llama)."""
    kv_heads, head_dim = kv_heads_of(text), head_dim_of(text)
    return [LayerCache(kind="full_kv", kv_heads=kv_heads, head_dim=head_dim) for _ in range(int(text.num_hidden_layers))]


def layer_type_caches(text: Any) -> list[LayerCache]:
    """Each layer's cache from the config's ``layer_types`` (Gemma 3, OLMo 3): ``sliding_attention``
    layers keep the last ``sliding_window`` tokens (``window_kv``), ``full_attention`` ones all."""
    kv_heads, head_dim = kv_heads_of(text), head_dim_of(text)
    out = []
    for i, kind in enumerate(text.layer_types[: int(text.num_hidden_layers)]):
        if kind not in ("sliding_attention", "full_attention"):
            raise ValueError(f"layer_types[{i}]={kind!r}: expected 'sliding_attention' or 'full_attention'")
        window = int(text.sliding_window) if kind == "sliding_attention" else None
        out.append(LayerCache(kind="window_kv" if window else "full_kv", kv_heads=kv_heads, head_dim=head_dim, window=window))
    return out


def dense(text: Any) -> None:
    """The ``moe`` of a dense family."""
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family. ``name``: its module's name. ``model_types``: every HF ``model_type`` it
    covers (text and ``ForConditionalGeneration`` configs). ``engine_model``: ``"module:Class"`` of
    its native engine model; None when only ``engine.backend: hf`` runs it. ``layer_caches``: the
    cache of each decoder layer from the text config. ``lora_targets``: the default
    ``model.lora.target_modules``. ``moe``: its :class:`MoEShape` (None: dense).
    ``packed_kernels``: what padding-free packed training must keep apart per sequence
    (``attention`` always; ``sliding_window``; ``linear_attention``: state restart).
    ``text_prefix``: where a ``ForConditionalGeneration`` checkpoint keeps the text tower
    (``model.language_model.``), "" for causal LMs. ``text_only``: a ``ForConditionalGeneration``
    checkpoint of this family trains its text tower only (text-only RL): the trainer loads the text
    decoder from it (:func:`tidal.models.loading.load_causal_lm`), its vision tower is not loaded.
    ``qk_norm``: how its attention normalises q and k: ``""`` not at all, ``"head"`` per head (Qwen3,
    Gemma 3: ``2 x head_dim`` weights), ``"projection"`` over the whole q and k projections (OLMo 3,
    OLMoE: ``q_dim + kv_dim`` weights); either keeps the same activation bytes for the backward.
    ``norms_per_layer``: RMSNorms on a decoder layer's residual path (2: pre-attention and pre-MLP;
    Gemma 3's sandwich adds post-attention and post-MLP ones). Both size the training activations
    in the memory plan. ``exact``: exact mode (``numerics.exact``, docs/exact.md) covers it: its engine model and its HF
    forward give the same bits (tested per family in tests/engine/test_exact.py)."""

    name: str
    model_types: tuple[str, ...]
    engine_model: str | None
    layer_caches: Callable[[Any], list[LayerCache]] = full_attention_caches
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    moe: Callable[[Any], MoEShape | None] = dense
    packed_kernels: frozenset[str] = frozenset({"attention"})
    text_prefix: str = ""
    text_only: bool = False
    qk_norm: str = ""
    norms_per_layer: int = 2
    exact: bool = False

    def __post_init__(self):
        if self.qk_norm not in ("", "head", "projection"):
            raise ValueError(f"Family {self.name}: qk_norm {self.qk_norm!r} must be '', 'head' or 'projection'")
        unknown = set(self.packed_kernels) - set(PACKED_KERNELS)
        if unknown or "attention" not in self.packed_kernels:
            raise ValueError(f"Family {self.name}: packed_kernels {sorted(self.packed_kernels)} must hold 'attention' "
                             f"and only {list(PACKED_KERNELS)}")

    @property
    def native(self) -> bool:
        """Whether the native engine runs this family."""
        return self.engine_model is not None


def text_tower_name(name: str, prefix: str) -> str | None:
    """The text decoder's name (``model.X`` / ``lm_head.X``) of a ``ForConditionalGeneration``
    weight ``name`` in either layout: in memory ``{prefix}X`` (``model.language_model.X``) and
    ``lm_head.X``; on disk, transformers' legacy ``language_model.model.X`` and
    ``language_model.lm_head.X`` (what ``save_pretrained`` writes for Gemma 3). None for any other
    weight (the vision tower, the projector)."""
    for src, dst in ((prefix, "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("lm_head.", "lm_head.")):
        if src and name.startswith(src):
            return dst + name[len(src):]
    return None


# ---- the routed experts' names on disk -------------------------------------------------------------
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# per-expert projection -> (stacked parameter, which rows of it: 0 gate, 1 up, None the whole down)
_STACKED_PART = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}


@dataclasses.dataclass(frozen=True)
class ExpertWeight:
    """Where a per-expert checkpoint weight goes among the stacked experts: ``stacked`` (the
    ``transformers`` 5 name, ``...mlp.experts.gate_up_proj`` ``[E, 2I, H]`` or ``...mlp.experts.down_proj``
    ``[E, H, I]``), ``expert`` (its index ``e``) and ``half`` (0: the gate rows ``[e, :I]``, 1: the up
    rows ``[e, I:]``, None: all of ``down_proj[e]``)."""

    stacked: str
    expert: int
    half: int | None


def expert_weight(name: str) -> ExpertWeight | None:
    """The stacked place of an MoE family's per-expert weight ``...experts.{e}.{gate,up,down}_proj.weight``
    (one tensor per expert: the layout of released Qwen3-MoE, OLMoE and Qwen3.5-MoE checkpoints and
    of ``save_pretrained`` in ``transformers`` 5.25, which stacks them when it loads); None for any
    other name (a stacked weight included). The one name mapping of the trainer's loading
    (:func:`tidal.models.loading.stacked_experts`) and the engine's (``PagedLM`` loads each expert
    into its slice)."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    param, half = _STACKED_PART[m.group(3)]
    return ExpertWeight(f"{m.group(1)}.{param}", int(m.group(2)), half)


# ---- reading a config (object or config.json dict) ----------------------------------------------
def namespace(config: Any) -> Any:
    """``config`` with attribute access: a dict (``config.json``) becomes nested namespaces."""
    if isinstance(config, Mapping):
        return types.SimpleNamespace(**{k: namespace(v) if isinstance(v, Mapping) else v for k, v in config.items()})
    return config


def text_config(config: Any) -> Any:
    """The decoder's config: ``get_text_config()`` of a HF config, ``text_config`` of a dict's
    namespace when there is one, else the config itself."""
    top = namespace(config)
    if hasattr(top, "get_text_config"):
        return top.get_text_config()
    return namespace(getattr(top, "text_config", None) or top)


def kv_heads_of(text: Any) -> int:
    return int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)


def head_dim_of(text: Any) -> int:
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


# ---- bytes ----------------------------------------------------------------------------------------
def _kv_heads_per_rank(cache: LayerCache, tp_size: int) -> int:
    """KV heads one TP rank holds (replicated when there are fewer than ``tp_size``)."""
    return max(1, cache.kv_heads // tp_size)


def kv_bytes_per_token(caches: list[LayerCache], dtype_bytes: int, tp_size: int) -> int:
    """K and V bytes one token adds on one TP rank over the layers that keep KV (``full_kv`` and
    ``window_kv``; a window layer's total is bounded per sequence: :func:`kv_bytes_per_sequence`).
    Recurrent layers add none."""
    return sum(2 * _kv_heads_per_rank(c, tp_size) * c.head_dim * dtype_bytes for c in caches if c.has_kv)


def pool_window(caches: list[LayerCache]) -> int | None:
    """The window of the window layers' own block pool in the native engine: the largest window of
    the ``window_kv`` layers when ``full_kv`` layers sit beside them (None otherwise: every
    attention layer's blocks in one pool; :mod:`tidal.engine.native.window_blocks`)."""
    windows = [c.window for c in caches if c.kind == "window_kv"]
    return max(windows) if windows and any(c.kind == "full_kv" for c in caches) else None


def has_window_pool(caches: list[LayerCache]) -> bool:
    return pool_window(caches) is not None


def kv_bytes_per_sequence(caches: list[LayerCache], seq_len: int, dtype_bytes: int, tp_size: int) -> int:
    """K and V bytes one sequence of ``seq_len`` tokens keeps on one TP rank: every token in a
    ``full_kv`` layer, at most ``window`` tokens in a ``window_kv`` layer (in tokens; the engine's
    paged blocks round this up to whole blocks)."""
    total = 0
    for c in caches:
        if c.has_kv:
            tokens = seq_len if c.window is None else min(seq_len, c.window)
            total += 2 * _kv_heads_per_rank(c, tp_size) * c.head_dim * dtype_bytes * tokens
    return total


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def state_bytes_per_sequence(caches: list[LayerCache], tp_size: int, dtype_bytes: int = 2) -> int:
    """Recurrent-state bytes one sequence keeps on one TP rank: each state tensor's elements split
    over the TP group along its first (head) dimension, at its ``state_dtype`` (``dtype_bytes``, the
    engine's, when the layer names none)."""
    total = 0
    for c in caches:
        size = _DTYPE_BYTES[c.state_dtype] if c.state_dtype else dtype_bytes
        for shape in c.state_shapes:
            n = 1
            for d in shape[1:]:
                n *= d
            total += -(-shape[0] // tp_size) * n * size
    return total
