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


def assert_completions_match_trainer(model, pad: int, comps, mm_rows, *, tol: float = 1e-4) -> None:
    """Each completion's sampling logprobs equal the trainer's forward (``token_logprobs`` with the
    rows' pixel inputs ``mm_rows[b]``) on prompt + completion."""
    from tidal.models.logprobs import token_logprobs
    from tidal.models.vision import collate_mm_inputs

    ids, am = padded_batch([c.prompt_ids + c.token_ids for c in comps], pad)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, am, mm_inputs=collate_mm_inputs(mm_rows))
    for b, c in enumerate(comps):
        P = len(c.prompt_ids)
        torch.testing.assert_close(lp[b, P : P + len(c.token_ids)], torch.tensor(c.logprobs), rtol=tol, atol=tol)
