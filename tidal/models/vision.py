"""Vision-language models (Qwen2-VL / Qwen2.5-VL style): model class, M-RoPE positions, batching.

A VL model's forward takes, besides the token ids, the pixel inputs of the images whose
placeholder tokens (``<|image_pad|>`` x n per image) the ids contain:

- ``pixel_values``: [P, C*t*p*p] the flattened patches of every image, image after image;
- ``image_grid_thw``: [I, 3] the (time, height, width) patch grid of each image.

One row's inputs are a dict with those two keys (its images in prompt order). A batch's inputs
(:func:`collate_mm_inputs`) are the rows' concatenated in row order, which is the order the model
matches placeholders in. Text rows contribute nothing; a batch without images has ``{}``, and
every caller passes that through the same code path as text.

A text-only batch on a VL model still runs the vision tower, on one blank image, adding
``0 * its output`` (:func:`vision_keepalive`): the tower's blocks are sharded units, and every rank
must enter their collectives (forward all-gathers, backward reduce-scatters) even when its own
micro-batch has no image while another rank's has.

Placeholders are the image tokens right after ``<|vision_start|>`` (what a chat template writes).
An image token a policy *generates* is text: the engine embedded it as a plain token, so the
trainer's forward (:func:`multimodal_body_inputs`) does the same, and the logprobs agree.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PretrainedConfig

MM_KEYS = ("pixel_values", "image_grid_thw")


def is_vision_language(config: PretrainedConfig) -> bool:
    """True for configs with a vision tower (``vision_config``), e.g. Qwen2VLConfig."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: PretrainedConfig):
    """The transformers Auto class that builds ``config``'s generative model (image-text-to-text for VL)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def collate_mm_inputs(rows: list[dict | None] | None, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The batch's multimodal inputs from per-row ones (None: a text row), on ``device``; {} if no image."""
    present = [r for r in rows or [] if r is not None]
    if not present:
        return {}
    out = {k: torch.cat([r[k] for r in present], dim=0) for k in MM_KEYS}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def image_token_id(config: PretrainedConfig) -> int:
    tid = getattr(config, "image_token_id", None)
    if tid is None:
        raise ValueError(f"{type(config).__name__} has no image_token_id: not a supported vision-language config")
    return int(tid)


def placeholder_mask(input_ids_BT: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """Bool [B, T]: image tokens in runs that start right after ``<|vision_start|>`` (the prompt's
    placeholders); any other image token is not one."""
    is_img_BT = input_ids_BT == image_token_id(config)
    prev_BT = torch.nn.functional.pad(input_ids_BT[:, :-1], (1, 0), value=-1)
    starts_BT = is_img_BT & (prev_BT != image_token_id(config))
    good_start_BT = starts_BT & (prev_BT == int(config.vision_start_token_id))
    pos_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
    run_start_BT = torch.where(starts_BT, pos_BT, torch.zeros_like(pos_BT)).cummax(dim=1).values
    return is_img_BT & good_start_BT.gather(1, run_start_BT)


def multimodal_body_inputs(
    hf_model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, mm_inputs: dict[str, torch.Tensor]
) -> dict:
    """Keyword inputs of a VL model's body (``hf_model.model``) for a batch with images: embeddings of
    the ids as they are, the ids the model looks for placeholders in (generated image tokens hidden
    behind ``<|vision_end|>``), M-RoPE positions and the pixel inputs."""
    config = hf_model.config
    stray_BT = (input_ids_BT == image_token_id(config)) & ~placeholder_mask(input_ids_BT, config)
    ids_BT = torch.where(stray_BT, torch.full_like(input_ids_BT, int(config.vision_end_token_id)), input_ids_BT)
    return dict(
        input_ids=ids_BT, inputs_embeds=hf_model.get_input_embeddings()(input_ids_BT), attention_mask=attention_mask_BT,
        position_ids=multimodal_position_ids(hf_model, ids_BT, attention_mask_BT, mm_inputs), **mm_inputs,
    )


def multimodal_position_ids(
    hf_model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, mm_inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """M-RoPE position ids [3, B, T] of a batch (any padding side; padding gets 0): image tokens
    take (t, h, w) grid positions, text continues after each image's largest position."""
    body = hf_model.model
    kwargs = dict(image_grid_thw=mm_inputs["image_grid_thw"], video_grid_thw=None, attention_mask=attention_mask_BT)
    if "mm_token_type_ids" in inspect.signature(body.get_rope_index).parameters:  # transformers >= 5
        kwargs["mm_token_type_ids"] = (input_ids_BT == image_token_id(hf_model.config)).int()
    position_ids_3BT, _ = body.get_rope_index(input_ids_BT, **kwargs)
    return position_ids_3BT


def vision_keepalive(hf_model: torch.nn.Module, like: torch.Tensor) -> torch.Tensor:
    """0 (a scalar in ``like``'s dtype, attached to the graph) from the vision tower run on one blank
    image of the smallest grid: keeps ranks in step through the tower's sharded collectives."""
    vc = hf_model.config.vision_config
    m = int(vc.spatial_merge_size)
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    grid_thw = torch.tensor([[1, m, m]], device=like.device)
    pixels = torch.zeros(m * m, dim, device=like.device, dtype=like.dtype)
    out = hf_model.model.get_image_features(pixels, grid_thw)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    total = sum(f.float().sum() for f in feats) if isinstance(feats, (list, tuple)) else feats.float().sum()
    return (0.0 * total).to(like.dtype)
