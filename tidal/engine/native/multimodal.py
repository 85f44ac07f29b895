"""Image prompts in the native engine (Qwen2-VL / Qwen2.5-VL style): what a prompt's images add to
the text path, as plain data the scheduler and runner can carry.

A prompt with images holds, right after each ``<|vision_start|>``, a run of ``<|image_pad|>``
placeholders, one per merged image patch (``t*h*w / merge**2`` for grid ``(t, h, w)``). Compared
with a text prompt it differs in three ways, all fixed when the prompt arrives:

- **Embeddings**: placeholder ``p`` (in prompt order) takes row ``feature_rows_L[p]`` of the vision
  tower's output for the prompt's images, instead of its token embedding. The features are
  computed once per prompt (shared by its ``n`` samples) the first time a prefill chunk needs them.
- **Positions** (M-RoPE): every prompt token has three position ids (time, height, width):
  ``positions_3L``. Text tokens have three equal ids; an image's tokens take their grid
  coordinates offset by the position where the image starts, and the text after an image goes on
  from the image's largest id + 1. Generated tokens are text: token ``i >= len(prompt)`` has three
  ids equal to ``i + rope_delta``, so a decode step is ordinary 1-D RoPE at a shifted position
  (CUDA graphs unchanged).
- **Prefix cache key**: the KV of a placeholder depends on the image, not only on the token id, so
  the prompt's block-hash chain starts from ``key`` (a hash of the pixel inputs): two prompts with
  the same text and different images never share blocks; the ``n`` samples of one prompt do.

An image token that is not in a run right after ``<|vision_start|>`` is text (the trainer's
forward treats it the same way: both use :func:`tidal.models.vision.placeholder_mask`).

This module knows nothing about the scheduler or the device loop; the model (which owns the vision
tower) turns ``pixel_values`` into features, see :class:`tidal.engine.native.models.dense.Qwen2VLForConditionalGeneration`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from tidal.models.vision import placeholder_mask


@dataclasses.dataclass(eq=False)
class MultimodalPrompt:
    """What one prompt's images add (see the module docstring). ``features`` is filled lazily by the
    model runner (``[num_placeholders, hidden]`` on the device) and lives as long as the prompt."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions_3L: np.ndarray
    feature_rows_L: np.ndarray
    rope_delta: int
    key: int
    features: torch.Tensor | None = None

    def positions_3(self, start: int, n: int) -> np.ndarray:
        """Position ids ``[3, n]`` of tokens ``start .. start+n-1`` (prompt or generated)."""
        L = self.positions_3L.shape[1]
        out = np.empty((3, n), dtype=np.int64)
        k = max(0, min(L, start + n) - start)
        out[:, :k] = self.positions_3L[:, start : start + k]
        out[:, k:] = np.arange(start + k, start + n, dtype=np.int64) + self.rope_delta
        return out


def _pixel_key(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(grid_thw.to(torch.int64).cpu().contiguous().numpy().tobytes())
    h.update(pixel_values.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def build_multimodal_prompt(
    prompt_ids: list[int], mm: dict[str, torch.Tensor], vl_config, where: str = "prompt"
) -> MultimodalPrompt:
    """The :class:`MultimodalPrompt` of ``prompt_ids`` with pixel inputs ``mm`` (``pixel_values``
    ``[P, C*t*p*p]``, ``image_grid_thw`` ``[I, 3]``) for the VL model config ``vl_config``. Raises
    ValueError, naming ``where``, when the placeholder runs do not match the images (count or length)."""
    if set(mm) != {"pixel_values", "image_grid_thw"}:
        raise ValueError(f"{where}: mm_inputs needs exactly pixel_values and image_grid_thw, got {sorted(mm)}")
    grid_I3 = mm["image_grid_thw"].to(torch.int64).cpu()
    if grid_I3.ndim != 2 or grid_I3.shape[1] != 3:
        raise ValueError(f"{where}: image_grid_thw must be [num_images, 3], got {list(grid_I3.shape)}")
    if int(grid_I3.prod(-1).sum()) != mm["pixel_values"].shape[0]:
        raise ValueError(f"{where}: pixel_values has {mm['pixel_values'].shape[0]} patches, image_grid_thw says "
                         f"{int(grid_I3.prod(-1).sum())}")
    ids_L = np.asarray(prompt_ids, dtype=np.int64)
    is_ph_L = placeholder_mask(torch.from_numpy(ids_L)[None], vl_config)[0].numpy()
    merge_size = int(vl_config.vision_config.spatial_merge_size)
    runs = []  # (start, end) of each placeholder run
    i = 0
    while i < len(ids_L):
        if is_ph_L[i]:
            j = i
            while j < len(ids_L) and is_ph_L[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    if len(runs) != grid_I3.shape[0]:
        raise ValueError(f"{where}: {len(runs)} image placeholder runs in the prompt for {grid_I3.shape[0]} images")
    positions_3L = np.empty((3, len(ids_L)), dtype=np.int64)
    feature_rows_L = np.full(len(ids_L), -1, dtype=np.int64)
    cur, prev_end, row = 0, 0, 0
    for (s, e), (t, h, w) in zip(runs, grid_I3.tolist()):
        if t != 1:
            raise ValueError(f"{where}: image grid {(t, h, w)} has t={t}: the native engine takes still images only "
                             f"(t=1); for video inputs set engine.backend=hf")
        gt, gh, gw = 1, h // merge_size, w // merge_size
        if e - s != gt * gh * gw:
            raise ValueError(f"{where}: an image of grid {(t, h, w)} needs {gt * gh * gw} placeholders, the prompt has {e - s}")
        positions_3L[:, prev_end:s] = np.arange(cur, cur + s - prev_end)
        cur += s - prev_end
        tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        positions_3L[:, s:e] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
        cur += max(gh, gw)
        feature_rows_L[s:e] = np.arange(row, row + e - s)
        row += e - s
        prev_end = e
    positions_3L[:, prev_end:] = np.arange(cur, cur + len(ids_L) - prev_end)
    rope_delta = int(positions_3L.max()) + 1 - len(ids_L)
    return MultimodalPrompt(
        pixel_values=mm["pixel_values"], image_grid_thw=grid_I3, positions_3L=positions_3L,
        feature_rows_L=feature_rows_L, rope_delta=rope_delta, key=_pixel_key(mm["pixel_values"], grid_I3),
    )


def mrope_section_columns(mrope_section: list[int], head_dim: int) -> torch.Tensor:
    """For each column of the ``[cos | sin]`` table (``head_dim`` wide), which of the three position
    ids (0 time, 1 height, 2 width) it rotates by: frequency ``j`` belongs to section ``s`` when
    ``sum(section[:s]) <= j < sum(section[:s+1])``, the same for its cos and its sin column."""
    half = head_dim // 2
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {half}")
    comp_half = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
    return torch.cat([comp_half, comp_half])


def mrope_cos_sin(cos_sin_PD: torch.Tensor, positions_3T: torch.Tensor, columns_D: torch.Tensor) -> torch.Tensor:
    """Per-token ``[cos | sin]`` rows ``[T, D]`` for M-RoPE: column d at position
    ``positions_3T[columns_D[d], t]`` of the 1-D table."""
    pos_TD = positions_3T[columns_D].T  # [T, D]
    return torch.gather(cos_sin_PD, 0, pos_TD)
