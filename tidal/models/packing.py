"""Padding-free forwards: a micro-batch of right-padded rows runs as one packed row of its real tokens.

Layout. A micro-batch is B right-padded rows ``[B, T]`` whose real tokens are a prefix of each row
(``attention_mask_BT``). Packed, they are one row of N tokens: row 0's real tokens, row 1's, ...
(M real tokens in all), then ``N - M`` padding tokens that form one dummy sequence of their own,
present when N is rounded up to a bucket (:func:`bucket_tokens`). Position ids restart at 0 in
every sequence; attention never crosses sequences (:mod:`tidal.models.varlen`, through
``cu_seqlens``). Nothing reads the dummy sequence: it only makes N one of a small set of sizes.

Targets. The tokens whose logprob (or value) is wanted are fixed when the batch is built
(``targets_BT``, e.g. the action mask): a target at packed position p is predicted by the hidden
state at p - 1, which is in the same sequence because a sequence's first token is never a target.
Only the target rows go through the LM head; results come back as ``[B, T]`` tensors (zero off the
targets), the layout the losses use, so a packed forward is a drop-in for a padded one.

Everything that needs host values (indices, lengths) is computed on the CPU when the batch is built
(:meth:`PackedBatch.build`), so a packed forward on the device never waits for the host.

Vision-language rows (Qwen2-VL / Qwen2.5-VL): M-RoPE positions ([3, ...]) are computed per row on the
padded layout with the model's own ``get_rope_index`` (as the padded forward does) and packed the
same way; the vision tower runs on the batch's images, its features replace the placeholders of the
packed row, and the language model runs packed.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tidal.sampling_filter import SamplingFilter
from tidal.models.lm_head import head_logprobs
from tidal.models.varlen import packed_attention_kwargs, uses_packed_attention
from tidal.models.vision import image_token_id, multimodal_position_ids, placeholder_mask, vision_keepalive

# packed lengths are rounded up to one of BUCKETS_PER_OCTAVE sizes per power of two (at most 1/16 =
# 6.25% extra tokens, about 3% on average), and to at least MIN_BUCKET tokens
BUCKETS_PER_OCTAVE = 16
MIN_BUCKET = 128


def bucket_tokens(n: int, cap: int | None = None) -> int:
    """The packed length for ``n`` real tokens: the smallest size ``>= n`` of the form
    ``k * 2^e / BUCKETS_PER_OCTAVE`` (and ``>= MIN_BUCKET``), lowered to ``cap`` (the micro-batch
    budget) when that is smaller but still ``>= n``, so a full micro-batch never grows past its budget."""
    if n <= MIN_BUCKET:
        size = MIN_BUCKET
    else:
        step = max(1, 2 ** (math.ceil(math.log2(n)) - 1) // BUCKETS_PER_OCTAVE)
        size = -(-n // step) * step
    return max(n, min(size, cap)) if cap is not None else size


@dataclasses.dataclass(kw_only=True, eq=False)
class PackedBatch:
    """The packed layout of one right-padded micro-batch (see the module docstring).

    input_ids_1N: [1, N] the rows' real tokens end to end, then the dummy sequence (``pad_id``).
    position_ids_1N: [1, N] each token's position in its own sequence.
    cu_seqlens: int32 [S + 1] sequence starts (S = B, plus 1 with a dummy sequence), ``cu_seqlens[S] = N``.
    max_seqlen: the longest sequence (host int).
    source_M: long [M] flat index ``b * T + t`` into [B, T] of the m-th packed (real) token.
    targets_K: long [K] packed positions of the targets (never a sequence start).
    target_source_K: long [K] their flat [B, T] indices.
    shape_BT: (B, T) of the padded micro-batch. num_real: M.
    """

    input_ids_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    source_M: torch.Tensor
    targets_K: torch.Tensor
    target_source_K: torch.Tensor
    shape_BT: tuple[int, int]
    num_real: int

    @property
    def num_tokens(self) -> int:
        """N, the packed length (real tokens plus the dummy sequence)."""
        return self.input_ids_1N.shape[1]

    @classmethod
    def build(
        cls, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *, targets_BT: torch.Tensor | None = None,
        pad_id: int = 0, cap: int | None = None, bucket: bool = True,
    ) -> "PackedBatch":
        """Pack CPU tensors ``input_ids_BT`` / ``attention_mask_BT`` (each row's ones a prefix, at
        least one per row). ``targets_BT`` (bool or 0/1): the positions whose logprobs/values are
        wanted; None: every real token but each row's first. ``bucket``: round N up with
        :func:`bucket_tokens` (``cap``: the micro-batch's token budget); else N = M."""
        B, T = input_ids_BT.shape
        am_BT = attention_mask_BT.to(torch.bool)
        lens_B = am_BT.sum(-1)
        if B == 0 or bool((lens_B == 0).any()):
            raise ValueError("every packed row needs at least one real token")
        cols_T = torch.arange(T)
        if not torch.equal(am_BT, cols_T[None, :] < lens_B[:, None]):
            raise ValueError("packing needs right-padded rows (each row's attention mask a prefix of ones)")
        M = int(lens_B.sum())
        N = bucket_tokens(M, cap) if bucket else M
        source_M = am_BT.reshape(-1).nonzero().squeeze(-1)
        seqlens = lens_B.tolist() + ([N - M] if N > M else [])
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens).cumsum(0)
        ids_N = torch.full((N,), pad_id, dtype=input_ids_BT.dtype)
        ids_N[:M] = input_ids_BT.reshape(-1)[source_M]
        pos_N = torch.arange(N) - cu[torch.searchsorted(cu[1:], torch.arange(N), right=True)].long()
        want_BT = am_BT if targets_BT is None else targets_BT.to(torch.bool) & am_BT
        want_BT = want_BT & (cols_T[None, :] > 0)  # a row's first token has no prediction
        targets_K = want_BT.reshape(-1)[source_M].nonzero().squeeze(-1)
        return cls(
            input_ids_1N=ids_N[None], position_ids_1N=pos_N[None], cu_seqlens=cu, max_seqlen=max(seqlens),
            source_M=source_M, targets_K=targets_K, target_source_K=source_M[targets_K], shape_BT=(B, T), num_real=M,
        )

    def to(self, device: torch.device) -> "PackedBatch":
        """The same batch with its tensors on ``device`` (non-blocking copies)."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(out, f.name, v.to(device, non_blocking=True))
        return out

    def attention_kwargs(self) -> dict:
        """The packed keyword arguments of an HF forward (:func:`tidal.models.varlen.packed_attention_kwargs`)."""
        return packed_attention_kwargs(self.cu_seqlens, self.max_seqlen)

    def pack(self, x_BT: torch.Tensor, fill=0) -> torch.Tensor:
        """``x_BT`` ([B, T, ...], on this batch's device) in packed order: [N, ...], ``fill`` on the dummy sequence."""
        B, T = self.shape_BT
        flat = x_BT.reshape(B * T, *x_BT.shape[2:]).index_select(0, self.source_M)
        pad = flat.new_full((self.num_tokens - self.num_real, *flat.shape[1:]), fill)
        return torch.cat([flat, pad]) if pad.shape[0] else flat

    def scatter_targets(self, x_K: torch.Tensor) -> torch.Tensor:
        """Per-target values back to [B, T] (zero elsewhere); differentiable, a fresh tensor (not a
        view: FSDP2 warns about outputs that are views)."""
        B, T = self.shape_BT
        src_K = self.target_source_K
        return x_K.new_zeros(B, T).index_put((src_K // T, src_K % T), x_K)


def pack_on_the_fly(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, targets_BT: torch.Tensor | None) -> PackedBatch:
    """The :class:`PackedBatch` of device tensors, built on the host (one synchronisation) and moved
    back: how a switched model serves a caller that did not pack (tests, ad-hoc scoring)."""
    return PackedBatch.build(input_ids_BT.cpu(), attention_mask_BT.cpu(), targets_BT=None if targets_BT is None else targets_BT.cpu(),
                             ).to(input_ids_BT.device)


# ---- forwards -------------------------------------------------------------------------------------------
def packed_hidden_states(
    hf_model: torch.nn.Module, packed: PackedBatch, input_ids_BT: torch.Tensor | None = None,
    attention_mask_BT: torch.Tensor | None = None, mm_inputs: dict | None = None,
) -> torch.Tensor:
    """Last hidden states [1, N, H] of an HF causal LM's body on the packed row (no LM head). The
    padded ``input_ids_BT`` / ``attention_mask_BT`` (on the device) are needed only with images
    (``mm_inputs``): the M-RoPE positions are computed on them. A text batch on a VL model runs the
    vision tower on a blank image as the padded forward does (:func:`tidal.models.vision.vision_keepalive`)."""
    _check_switched(hf_model)
    if mm_inputs:
        return _multimodal_hidden_states(hf_model, packed, input_ids_BT, attention_mask_BT, mm_inputs)
    zero = None
    if getattr(hf_model.config, "vision_config", None) is not None:
        zero = vision_keepalive(hf_model, hf_model.get_input_embeddings().weight)
    out = hf_model.get_decoder()(input_ids=packed.input_ids_1N, position_ids=packed.position_ids_1N, attention_mask=None,
                                 use_cache=False, **packed.attention_kwargs())
    return out.last_hidden_state if zero is None else out.last_hidden_state + zero


def _check_switched(model: torch.nn.Module) -> None:
    """A model whose decoder still runs another attention would attend across the packed sequences."""
    if not uses_packed_attention(model):
        raise ValueError(f"{type(model).__name__} is not switched to packed attention: call "
                         "tidal.models.varlen.enable_packed_attention(model) before preparing it")


def _image_features(body: torch.nn.Module, mm_inputs: dict) -> torch.Tensor:
    """The vision tower's features of the batch's images, [placeholders, H], image after image."""
    out = body.get_image_features(mm_inputs["pixel_values"], mm_inputs["image_grid_thw"])
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats


def _multimodal_hidden_states(hf_model, packed: PackedBatch, input_ids_BT, attention_mask_BT, mm_inputs) -> torch.Tensor:
    """The VL body on the packed row: the padded forward's inputs (placeholders, stray image tokens
    kept as text, M-RoPE positions; see :func:`tidal.models.vision.multimodal_body_inputs`) packed,
    then the vision tower and the language model called apart, so the packed keyword arguments
    reach only the language model's attention."""
    if input_ids_BT is None or attention_mask_BT is None:
        raise ValueError("a packed forward with images needs the padded input_ids_BT and attention_mask_BT (M-RoPE positions)")
    config, body = hf_model.config, hf_model.model
    if config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise NotImplementedError(f"packed forwards with images support qwen2_vl and qwen2_5_vl, not {config.model_type}")
    holes_BT = placeholder_mask(input_ids_BT, config)
    stray_BT = (input_ids_BT == image_token_id(config)) & ~holes_BT
    ids_BT = torch.where(stray_BT, torch.full_like(input_ids_BT, int(config.vision_end_token_id)), input_ids_BT)
    pos_3BT = multimodal_position_ids(hf_model, ids_BT, attention_mask_BT, mm_inputs)
    dummy_N = packed.position_ids_1N[0, packed.num_real :]
    pos_3N = torch.cat([packed.pack(pos_3BT.permute(1, 2, 0))[: packed.num_real].T, dummy_N.expand(3, -1)], dim=1)
    embeds_1NH = hf_model.get_input_embeddings()(packed.input_ids_1N)
    holes_1N1 = packed.pack(holes_BT, fill=False)[None, :, None]
    feats_PH = _image_features(body, mm_inputs).to(embeds_1NH.dtype)
    embeds_1NH = embeds_1NH.masked_scatter(holes_1N1.expand_as(embeds_1NH), feats_PH)
    out = body.language_model(inputs_embeds=embeds_1NH, position_ids=pos_3N[:, None, :], attention_mask=None,
                              use_cache=False, **packed.attention_kwargs())
    return out.last_hidden_state


def packed_token_logprobs(
    hf_model: torch.nn.Module, packed: PackedBatch, input_ids_BT: torch.Tensor | None = None,
    attention_mask_BT: torch.Tensor | None = None, *, sampling: SamplingFilter = SamplingFilter(), with_entropy: bool = False,
    chunk_tokens: int = 2048, mm_inputs: dict | None = None, entropy_grad: bool = True, compile_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the packed batch's targets, as [B, T] fp32 tensors aligned with
    the padded rows (the layout of :func:`tidal.models.lm_head.lm_head_logprobs`; zero off the
    targets). The LM head runs on the K target rows only. Arguments as in
    :func:`tidal.models.logprobs.token_logprobs`; reach this through ``token_logprobs(..., packed=)``
    so sharded models unshard around it."""
    hidden_1NH = packed_hidden_states(hf_model, packed, input_ids_BT, attention_mask_BT, mm_inputs)
    hidden_KH = hidden_1NH[0].index_select(0, packed.targets_K - 1)
    labels_K = packed.input_ids_1N[0].index_select(0, packed.targets_K)
    logp_K, entropy_K = head_logprobs(
        hidden_KH, hf_model.get_output_embeddings(), labels_K, sampling=sampling, with_entropy=with_entropy,
        chunk_tokens=chunk_tokens, entropy_grad=entropy_grad, compile_head=compile_head,
    )
    return packed.scatter_targets(logp_K), packed.scatter_targets(entropy_K) if with_entropy else None


def packed_critic_values(critic: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """``values_BT[b, t] = V(tokens < t)`` (the critic's output at the previous position, as
    :func:`tidal.models.loading.critic_values`) at the packed batch's targets, zero elsewhere; fp32.
    Reach it through ``critic_values(..., packed=)``."""
    _check_switched(critic)
    out = critic(input_ids=packed.input_ids_1N, position_ids=packed.position_ids_1N, attention_mask=None, use_cache=False,
                 **packed.attention_kwargs())
    v_N = out.logits[0, :, 0].float()
    return packed.scatter_targets(v_N.index_select(0, packed.targets_K - 1))
