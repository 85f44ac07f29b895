"""Per-sequence generation budgets for training rollouts: the
:attr:`ExperienceMaker.completion_budget <tidal.trainer.experience_maker.ExperienceMaker>` hook.

A :class:`CompletionBudget` gives every sequence of a rollout its own ``max_new_tokens`` (length
curricula, per-prompt thinking budgets, or a benchmark's drawn lengths that every framework must
reproduce). With ``end_token_id`` it is *budget forcing*: a sequence that reaches its budget ends
with that token (EOS, an end-of-thinking marker) instead of its last sampled one.

Why replacing the last token is exact: forcing a token at the last step is sampling from a
distribution with all its mass on that token, so its sampling logprob is 0.0 (``Completion``
logprobs are those of the processed distribution actually sampled from), and nothing is conditioned
on the last token of a finished sequence; the device work is the same step either way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from tidal.data import PromptItem
from tidal.distributed.generate import check_budgets
from tidal.engine.base import SamplingParams


@dataclasses.dataclass(kw_only=True, frozen=True)
class CompletionBudget:
    """Budgets of one rollout's sequences.

    lengths: ``lengths(items, params)`` -> one budget per sequence, prompt-major (``params.n`` per
        item, in the order the completions come back), each in ``1..params.max_new_tokens``. Called
        once per rollout (each sampling round of dynamic sampling is one).
    end_token_id: None: a sequence that reaches its budget stops there (``finish_reason="length"``,
        as at ``max_new_tokens``). A token id: the sequence's last token becomes this one with
        logprob 0.0 and ``finish_reason="stop"`` (budget forcing; see the module docstring). A
        sequence that stopped earlier on its own, or that the model's context cut short of its
        budget, is left as it is.
    """

    lengths: Callable[[list[PromptItem], SamplingParams], Sequence[int]]
    end_token_id: int | None = None

    def budgets(self, items: list[PromptItem], params: SamplingParams) -> list[int]:
        """The checked budgets of ``items`` (ValueError naming the hook when they do not fit)."""
        budgets = [int(b) for b in self.lengths(items, params)]
        try:
            check_budgets(budgets, len(items) * params.n, params.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"ExperienceMaker.completion_budget: {e}") from None
        return budgets
