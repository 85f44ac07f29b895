"""Prompts with images: image loading, placeholders in chat messages, image tokens and pixel inputs.

Contract:
- A row's images (``data.image_key``) are local file paths (absolute, or relative to the data
  file's folder), raw bytes, ``{"bytes": ..., "path": ...}`` dicts (what Hugging Face ``datasets``
  writes for an ``Image`` column in Parquet) or PIL images. :func:`load_image` opens any of them.
- :func:`place_images` puts one ``{"type": "image"}`` content item per image into the chat: at each
  ``<image>`` placeholder of the text if there are any (their count must equal the images'), else
  before the text of the first user message. Content that is already a list is kept as is.
- :class:`VisionProcessor` is a tokenizer plus an image processor (Qwen2-VL style). It renders the
  chat template, and expands each ``<|image_pad|>`` of the rendered text into the number of tokens
  the image takes (``t*h*w / merge_size**2`` of its patch grid), which is what the model expects.
  For text it behaves as its tokenizer (``decode``, ``pad_token_id``, ...). It does not use
  ``transformers``' processor classes, whose video part needs torchvision.
- :class:`~tidal.data.PromptDataset` turns a row's images into image tokens and pixel inputs only
  when its tokenizer is a :class:`VisionProcessor` (what :func:`tidal.models.load_tokenizer` returns
  for a folder with ``preprocessor_config.json``); with a text tokenizer images pass through untouched.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_PLACEHOLDER = "<image>"
IMAGE_TOKEN = "<|image_pad|>"


def load_image(ref: Any, base_dir: str | os.PathLike | None = None):
    """A PIL RGB image from a path, bytes, a ``{"bytes", "path"}`` dict or a PIL image."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return load_image(ref["bytes"], base_dir)
        if ref.get("path"):
            return load_image(ref["path"], base_dir)
        raise ValueError(f"image dict has neither 'bytes' nor 'path': keys {sorted(ref)}")
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref)).convert("RGB")
    if isinstance(ref, (str, os.PathLike)):
        path = Path(ref)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise FileNotFoundError(f"image not found: {path}")
        with Image.open(path) as im:
            return im.convert("RGB")
    raise ValueError(f"cannot read an image from a {type(ref).__name__}")


def place_images(where: str, messages: list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """``messages`` with ``n_images`` image items placed as the module docstring says."""
    listed = sum(1 for m in messages if isinstance(m["content"], list) for c in m["content"] if c.get("type") == "image")
    if listed:
        if listed != n_images:
            raise ValueError(f"{where}: the messages list {listed} image items but the row has {n_images} images")
        return messages
    marks = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m["content"], str))
    if marks and marks != n_images:
        raise ValueError(f"{where}: the text has {marks} '{IMAGE_PLACEHOLDER}' placeholders but the row has {n_images} images")
    out = []
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise ValueError(f"{where}: a row with images needs a user message to put them in")
    for i, m in enumerate(messages):
        text = m["content"]
        if marks and isinstance(text, str) and IMAGE_PLACEHOLDER in text:
            parts = text.split(IMAGE_PLACEHOLDER)
            content = [{"type": "text", "text": parts[0]}] if parts[0] else []
            for part in parts[1:]:
                content.append({"type": "image"})
                if part:
                    content.append({"type": "text", "text": part})
            m = {**m, "content": content}
        elif not marks and i == first_user:
            m = {**m, "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}
        out.append(m)
    return out


class VisionProcessor:
    """A tokenizer and an image processor: chat text + images -> prompt ids and pixel inputs."""

    def __init__(self, tokenizer: Any, image_processor: Any, *, image_token: str = IMAGE_TOKEN):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {image_token!r} token; it is not a Qwen2-VL-style tokenizer")
        self.merge_size = int(getattr(image_processor, "merge_size", 2))

    def __getattr__(self, name: str):  # text behaviour (decode, pad_token_id, chat_template, ...) is the tokenizer's
        if name in ("tokenizer", "image_processor"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def pixel_inputs(self, images: list) -> dict[str, torch.Tensor]:
        """``pixel_values`` [P, D] and ``image_grid_thw`` [I, 3] of PIL ``images``."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def expand_image_tokens(self, text: str, image_grid_thw: torch.Tensor) -> str:
        """``text`` with its i-th ``<|image_pad|>`` repeated for image i's number of tokens."""
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(image_grid_thw):
            raise ValueError(f"the prompt has {len(parts) - 1} {self.image_token} tokens but there are {len(image_grid_thw)} images")
        counts = [int(g.prod()) // self.merge_size**2 for g in image_grid_thw]
        return parts[0] + "".join(self.image_token * n + p for n, p in zip(counts, parts[1:]))

    def prompt_ids(self, text: str, images: list) -> list[int]:
        """Token ids of a rendered prompt with its image tokens expanded for ``images`` (PIL)."""
        grid = self.pixel_inputs(images)["image_grid_thw"]
        return self.tokenizer(self.expand_image_tokens(text, grid), add_special_tokens=False)["input_ids"]

    def save_pretrained(self, path: str | os.PathLike) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)


def load_image_processor(path: str):
    """The image processor of a model folder (``preprocessor_config.json``), or None when it has none.
    Without torchvision transformers falls back to the PIL implementation of the same processor."""
    cfg_file = Path(path) / "preprocessor_config.json"
    if not cfg_file.is_file():
        return None
    import transformers

    name = json.loads(cfg_file.read_text()).get("image_processor_type", "")
    cls = getattr(transformers, name.removesuffix("Fast"), None) if name else None
    if cls is None:
        raise ValueError(f"{cfg_file}: unknown image_processor_type {name!r}")
    return cls.from_pretrained(path)


# ---- PromptDataset hooks ------------------------------------------------------------------------------
# Images become image tokens only with a VisionProcessor (a vision-language model's folder); with a
# text tokenizer a row's images are passed through untouched (e.g. for a reward function).
def place_row_images(where: str, parsed, cfg, tokenizer: Any):
    """A parsed row with its images placed into its chat (unchanged without images or for a text tokenizer)."""
    if not parsed.images or not isinstance(tokenizer, VisionProcessor):
        return parsed
    if parsed.messages is None:
        raise ValueError(f"{where}: a row with images needs data.apply_chat_template: true (image tokens come from the chat template)")
    return dataclasses.replace(parsed, messages=place_images(where, parsed.messages, len(parsed.images)))


def expand_image_rows(tokenizer: Any, cfg, source_path: str, wheres: list[str], parsed: list, texts: list[str], ids_list: list):
    """Token ids of every row, those of rows with images re-encoded with their image tokens expanded."""
    if not isinstance(tokenizer, VisionProcessor):
        return ids_list
    out = list(ids_list)
    base = Path(source_path).parent
    for i, (where, p) in enumerate(zip(wheres, parsed)):
        if not p.images:
            continue
        images = [load_image(ref, base) for ref in p.images]
        out[i] = np.asarray(tokenizer.prompt_ids(texts[i], images), dtype=np.int32)
        if len(out[i]) > cfg.max_prompt_len and cfg.overlong_prompt == "left_truncate":
            raise ValueError(
                f"{where}: prompt with images has {len(out[i])} tokens > data.max_prompt_len={cfg.max_prompt_len}; "
                f"image prompts cannot be left-truncated (raise max_prompt_len, or set data.overlong_prompt to drop)"
            )
    return out


def image_inputs(tokenizer: Any, images: list | None, source_path: str) -> dict[str, torch.Tensor] | None:
    """Pixel inputs of a row's images (relative paths resolved against its data file's folder);
    None for a row without images or a text tokenizer."""
    if not images or not isinstance(tokenizer, VisionProcessor):
        return None
    base = Path(source_path).parent
    return tokenizer.pixel_inputs([load_image(ref, base) for ref in images])
