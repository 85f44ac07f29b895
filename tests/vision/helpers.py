"""Small helpers shared by the vision tests."""

import torch


def padded_batch(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and attention mask of token lists."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    am = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        am[b, : len(r)] = 1
    return ids, am
