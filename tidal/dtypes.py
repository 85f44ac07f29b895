"""The one rule that turns a configured dtype name into a torch dtype."""

from __future__ import annotations

import torch


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA, float32 elsewhere; otherwise the torch dtype of that name
    (``bfloat16``, ``float16``, ``float32``)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, name)
