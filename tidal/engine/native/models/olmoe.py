"""OLMoE in the native engine: every layer sparse (:mod:`tidal.families.olmoe`), attention with q/k
RMSNorm over all heads together and ``clip_qkv`` clamping."""

from __future__ import annotations

import torch

from tidal.engine.native.layers import RMSNorm
from tidal.engine.native.models.dense import DecoderLM, SelfAttention
from tidal.engine.native.models.moe_layers import body_config, use_moe_blocks
from tidal.engine.native.parallel import TPGroup
from tidal.families.olmoe import moe


class OlmoeAttention(SelfAttention):
    """OLMoE attention: RMSNorm over all q (and all k) heads together, then ``clip_qkv`` clamping.
    The norm spans every head, so it needs the whole projection: TP=1 only."""

    def __init__(self, cfg, tp: TPGroup, ops, dtype, bias: bool):
        if tp.size > 1:
            raise ValueError("olmoe: the native engine runs OLMoE at TP 1 (its q/k RMSNorm spans all heads); "
                             "set engine.tp_size: 1")
        super().__init__(cfg, tp, ops, dtype, bias, bias, qk_norm=False)
        self.q_full_norm = RMSNorm(self.nh * self.d, cfg.rms_norm_eps, ops, dtype)
        self.k_full_norm = RMSNorm(self.nkv * self.d, cfg.rms_norm_eps, ops, dtype)
        self.clip = cfg.clip_qkv

    def forward(self, positions_T, x_TH, cos_sin_PD, meta):
        T = x_TH.shape[0]
        q, k, v = self.qkv_proj(x_TH).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q, k = self.q_full_norm(q)[0], self.k_full_norm(k)[0]
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = self.ops.rope_store(q.view(T, self.nh, self.d), k.view(T, self.nkv, self.d), v.view(T, self.nkv, self.d),
                                positions_T, cos_sin_PD, self.attn.k_cache, self.attn.v_cache, meta.slot_mapping_T)
        return self.o_proj(self.attn(q, meta).reshape(T, self.nh * self.d))


class OlmoeForCausalLM(DecoderLM):
    """OLMoE: every layer sparse (softmax top-k, ``norm_topk_prob``, no shared expert); attention as
    :class:`OlmoeAttention`. HF names ``self_attn.q_norm`` / ``k_norm`` load into ``q_full_norm`` /
    ``k_full_norm``."""

    packed_modules_mapping = {**DecoderLM.packed_modules_mapping,
                              "q_norm": ("q_full_norm", None), "k_norm": ("k_full_norm", None)}

    @staticmethod
    def biases(cfg):
        b = bool(getattr(cfg, "attention_bias", False))
        return {"qkv": b, "o": b, "mlp": False}

    def __init__(self, cfg, tp: TPGroup, ops, dtype: torch.dtype):
        shape = moe(cfg)
        super().__init__(body_config(cfg, shape, tp), tp, ops, dtype)
        self.config = cfg
        for layer in self.model.layers:
            layer.self_attn = OlmoeAttention(cfg, tp, ops, dtype, self.biases(cfg)["qkv"])
        use_moe_blocks(self, cfg, shape, tp, ops, dtype)
