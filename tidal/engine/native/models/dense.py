"""Decoder-only LMs of the Qwen2 / Qwen2.5 / Qwen3 / Llama families, tensor-parallel, on paged KV.

The families differ only in biases and per-head q/k RMSNorm; one module covers them and a small
registered subclass per HF ``model_type`` states the differences. The model owns its weight-name
mapping: HF names (``model.layers.0.self_attn.q_proj.weight``) are mapped onto packed parameters
(``qkv_proj``, ``gate_up_proj``) by :attr:`DecoderLM.packed_modules_mapping`.

``forward(ids_T, positions_T, meta)`` runs the flat batch of new tokens; ``compute_logits`` applies
the LM head to the rows that sample. Each class is its family's ``engine_model``
(:mod:`tidal.families`).
"""

from __future__ import annotations

import importlib
from typing import Iterable

import torch
from torch import nn

from tidal.engine.native.attention import AttnMetadata, PagedAttention
from tidal.engine.native.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_cos_sin,
)
from tidal.engine.native.multimodal import MultimodalPrompt, build_multimodal_prompt, mrope_cos_sin, mrope_section_columns
from tidal.engine.native.parallel import TPGroup
from tidal.families import expert_weight


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class SelfAttention(nn.Module):
    def __init__(self, cfg, tp: TPGroup, ops, dtype, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        d = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, qkv_bias, tp, dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, o_bias, tp, dtype)
        self.nh, self.nkv, self.d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops, dtype) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops, dtype) if qk_norm else None
        self.attn = PagedAttention(self.nh, self.nkv, d, ops)
        self.ops = ops

    def forward(self, positions_T, x_TH, cos_sin_PD, meta: AttnMetadata):
        T = x_TH.shape[0]
        q, k, v = self.qkv_proj(x_TH).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k, v = q.view(T, self.nh, self.d), k.view(T, self.nkv, self.d), v.view(T, self.nkv, self.d)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.d))[0].view(T, self.nh, self.d)
            k = self.k_norm(k.reshape(-1, self.d))[0].view(T, self.nkv, self.d)
        q = self.ops.rope_store(
            q, k, v, positions_T, cos_sin_PD, self.attn.k_cache, self.attn.v_cache, meta.slot_mapping_T
        )
        o = self.attn(q, meta)
        return self.o_proj(o.reshape(T, self.nh * self.d))


class MLP(nn.Module):
    """The gated MLP ``down(silu(gate x) * up x)`` of ``intermediate`` (default: the config's
    ``intermediate_size``; an MoE's shared expert has its own)."""

    def __init__(self, cfg, tp: TPGroup, ops, dtype, bias: bool, intermediate: int | None = None):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: only silu is supported")
        i = cfg.intermediate_size if intermediate is None else intermediate
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [i, i], bias, tp, dtype)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, bias, tp, dtype)
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, tp, ops, dtype, biases: dict[str, bool], qk_norm: bool):
        super().__init__()
        self.self_attn = SelfAttention(cfg, tp, ops, dtype, biases["qkv"], biases["o"], qk_norm)
        self.mlp = MLP(cfg, tp, ops, dtype, biases["mlp"])
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)

    def forward(self, positions_T, x_TH, residual_TH, cos_sin_PD, meta):
        x_TH, residual_TH = self.input_layernorm(x_TH, residual_TH)
        x_TH = self.self_attn(positions_T, x_TH, cos_sin_PD, meta)
        x_TH, residual_TH = self.post_attention_layernorm(x_TH, residual_TH)
        return self.mlp(x_TH), residual_TH


class DecoderBody(nn.Module):
    """``model.*`` of the HF checkpoint: embedding, layers, final norm."""

    def __init__(self, cfg, tp, ops, dtype, biases, qk_norm):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, ops, dtype, biases, qk_norm) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)


class PagedLM(nn.Module):
    """What every native engine model shares: parameters named like the HF checkpoint, with the
    projections of :attr:`packed_modules_mapping` packed (q/k/v, gate/up); logits on TP rank 0;
    loading and verifying HF-named weights; the paged attention modules the runner gives caches.
    A subclass builds ``self.model`` (the HF ``model.*`` body), ``self.lm_head``, ``max_positions``
    and a ``cos_sin_PD`` buffer (its dtype is the KV cache's), and defines ``forward``."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self):
        super().__init__()
        self._load_targets: dict = {}  # HF weight name -> (module, parameter, shard id) or None

    def compute_logits(self, hidden_BH: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[B, vocab]`` on TP rank 0, None on the others."""
        return self.lm_head(hidden_BH)

    multimodal = False  # True for models that take images (see Qwen2VLForConditionalGeneration)

    def layer_attentions(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named full tensors into the (sharded, packed) parameters in place. Returns the
        names loaded. Raises KeyError on a name this model has no place for."""
        loaded = set()
        with torch.no_grad():
            for name, slices in self.weight_slices(named_tensors):
                for dst, src in slices:
                    dst.copy_(src) if src is not None else dst.zero_()
                loaded.add(name)
        return loaded

    @torch.no_grad()
    def verify_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The HF names whose live parameter values differ from the given full tensors (empty: the
        engine holds exactly what was sent); one device read of the weights and one host sync."""
        names, flags = [], []
        for name, slices in self.weight_slices(named_tensors):
            for dst, src in slices:
                names.append(name)
                flags.append((dst != src.to(dst.dtype)).any() if src is not None else dst.any())
        bad = torch.stack(flags).tolist() if flags else []
        return sorted({n for n, b in zip(names, bad) if b})

    def weight_slices(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """(HF name, [(destination view, source view or None for zeros), ...]) of each weight this
        model keeps (the layers' ``weight_slices``: TP shard, packed q/k/v and gate/up); skipped
        weights (RoPE frequencies, a tied LM head) are left out. KeyError on a name with no place."""
        for name, full in named_tensors:
            target = self._load_target(name)
            if target is None:
                continue
            module, param, shard_id = target
            yield name, module.weight_slices(param, full, shard_id)

    def _load_target(self, name: str):
        """(module, parameter, shard id) that HF weight ``name`` loads into; None for a weight this
        model skips (RoPE frequencies, a tied LM head). Resolved once per name (weight syncs repeat)."""
        cache = self._load_targets
        if name in cache:
            return cache[name]
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head.tied):
            cache[name] = None
            return None
        target, shard_id = name, None
        expert = expert_weight(name)  # one expert of a checkpoint's MoE layer: its slice of the stacked experts
        if expert is not None:
            target, shard_id = expert.stacked, expert
        else:
            for hf_part, (ours, sid) in self.packed_modules_mapping.items():
                if f".{hf_part}." in name:
                    target, shard_id = name.replace(f".{hf_part}.", f".{ours}."), sid
                    break
        module_name, _, param_name = target.rpartition(".")
        try:
            module = self.get_submodule(module_name)
            param = getattr(module, param_name)
        except AttributeError:
            raise KeyError(f"weight {name!r} has no place in {type(self).__name__}") from None
        if not isinstance(param, nn.Parameter) or not hasattr(module, "weight_slices"):
            raise KeyError(f"weight {name!r} has no place in {type(self).__name__}")
        cache[name] = (module, param, shard_id)
        return cache[name]


class DecoderLM(PagedLM):
    """A Qwen2/Qwen3/Llama-style causal LM: pre-norm layers with a fused residual add, one RoPE table."""

    qk_norm = False

    @staticmethod
    def biases(cfg) -> dict[str, bool]:
        raise NotImplementedError

    def __init__(self, cfg, tp: TPGroup, ops, dtype: torch.dtype):
        super().__init__()
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported by the native engine")
        self.config = cfg
        self.model = DecoderBody(cfg, tp, ops, dtype, self.biases(cfg), self.qk_norm)
        tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(self.model.embed_tokens, tie, tp, dtype)
        self.max_positions = cfg.max_position_embeddings
        self.register_buffer("cos_sin_PD", rope_cos_sin(cfg, head_dim_of(cfg), self.max_positions, dtype), False)

    def forward(
        self, ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttnMetadata,
        embeds_TH: torch.Tensor | None = None, cos_sin_TD: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, H]``. ``embeds_TH`` replaces the token embeddings (image features in
        place); ``cos_sin_TD`` gives each token its own RoPE row (M-RoPE), ``positions_T`` then unused."""
        x, residual = self.model.embed_tokens(ids_T) if embeds_TH is None else embeds_TH, None
        cos_sin = self.cos_sin_PD
        if cos_sin_TD is not None:
            cos_sin, positions_T = cos_sin_TD, torch.arange(ids_T.shape[0], device=ids_T.device)
        for layer in self.model.layers:
            x, residual = layer(positions_T, x, residual, cos_sin, meta)
        return self.model.norm(x, residual)[0]


class Qwen2ForCausalLM(DecoderLM):
    """Qwen2 / Qwen2.5: bias on q/k/v only."""

    @staticmethod
    def biases(cfg):
        return {"qkv": True, "o": False, "mlp": False}


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3: per-head RMSNorm on q and k before RoPE; biases only if ``attention_bias``."""

    qk_norm = True

    @staticmethod
    def biases(cfg):
        b = bool(getattr(cfg, "attention_bias", False))
        return {"qkv": b, "o": b, "mlp": False}


class LlamaForCausalLM(DecoderLM):
    """Llama 2/3: ``attention_bias`` on q/k/v/o, ``mlp_bias`` on the MLP."""

    @staticmethod
    def biases(cfg):
        b = bool(getattr(cfg, "attention_bias", False))
        return {"qkv": b, "o": b, "mlp": bool(getattr(cfg, "mlp_bias", False))}


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """Qwen2-VL: the Qwen2 decoder with M-RoPE, and the HF vision tower (replicated on every TP rank,
    unsharded; its output is identical on all of them). Image prompts: :mod:`tidal.engine.native.multimodal`.

    Weight names: the actor's (``model.language_model.*``, ``model.visual.*``, ``lm_head.*``) and
    the on-disk layout of released checkpoints (``model.*``, ``visual.*``) both load.
    """

    multimodal = True
    vision_tower_class = "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel"

    def __init__(self, cfg, tp: TPGroup, ops, dtype: torch.dtype):
        text = cfg.get_text_config()
        super().__init__(text, tp, ops, dtype)
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        if "mrope_section" not in rope:
            raise ValueError(f"{type(cfg).__name__}: text config has no rope mrope_section")
        self.vl_config = cfg
        self.register_buffer("mrope_columns_D", mrope_section_columns(list(rope["mrope_section"]), head_dim_of(text)), False)
        module, _, name = self.vision_tower_class.partition(":")
        tower_cls = getattr(importlib.import_module(module), name)
        self.visual = tower_cls._from_config(cfg.vision_config, dtype=dtype).eval()

    def multimodal_prompt(self, prompt_ids: list[int], mm: dict, where: str) -> MultimodalPrompt:
        return build_multimodal_prompt(prompt_ids, mm, self.vl_config, where=where)

    def image_features(self, mm: MultimodalPrompt) -> torch.Tensor:
        """``[num_placeholders, hidden]``: the vision tower's merged patch features of ``mm``'s images."""
        device = self.cos_sin_PD.device
        out = self.visual(mm.pixel_values.to(device, self.cos_sin_PD.dtype), grid_thw=mm.image_grid_thw.to(device))
        return out.pooler_output if hasattr(out, "pooler_output") else out

    def rope_rows(self, positions_3T: torch.Tensor) -> torch.Tensor:
        return mrope_cos_sin(self.cos_sin_PD, positions_3T, self.mrope_columns_D)

    def weight_slices(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Vision weights map onto the (replicated) tower as they are; text weights as in
        :meth:`DecoderLM.weight_slices`, named either way (``model.language_model.*`` or ``model.*``)."""
        visual = dict(self.visual.named_parameters())
        for name, full in named_tensors:
            if name.startswith(("model.visual.", "visual.")):
                key = name.split("visual.", 1)[1]
                if key not in visual:
                    raise KeyError(f"weight {name!r} has no place in the vision tower")
                yield name, [(visual[key].data, full)]
                continue
            text = "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name
            for _, slices in super().weight_slices([(text, full)]):
                yield name, slices


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same decoder and M-RoPE for images; its own vision tower (window attention)."""

    vision_tower_class = "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel"
