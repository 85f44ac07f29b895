"""Plain reference computations the fast paths are tested against."""

import torch


def reference_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-logits token logprobs in the layout of :func:`tidal.models.logprobs.lm_head_logprobs`:
    ``logp_BT[b, t] = log softmax(logits[b, t-1] / T)[ids[b, t]]``, position 0 is 0."""
    logp_BTV = (logits_BTV.float() / temperature).log_softmax(-1)
    logp = logp_BTV[:, :-1].gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
