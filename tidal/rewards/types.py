"""What a reward sees and returns. Rewards score the RESPONSE; the prompt is given separately, never mixed in."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is not imported at run time: reward worker processes unpickle RewardSample
    import torch


# How deep lists and objects may nest in a sample's JSON values (reference, metadata, messages): a
# sample crosses process boundaries pickled, and pickling recurses once per level (600 levels broke
# a worker pool for good). Checked where samples enter: data rows and reward-service requests.
MAX_NESTING = 100


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How deep dicts, lists and tuples nest in ``value`` (a scalar: 0; ``{"a": [1]}``: 2), counted
    without recursion and only up to ``limit + 1`` (deeper values stop the count there)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        stack.extend((c, depth + 1) for c in children)
    return deepest


@dataclasses.dataclass(kw_only=True)
class RewardSample:
    """One generated sample to score.

    prompt: the prompt text as given to the model (chat template applied).
    response: the decoded response only (special tokens skipped). In a multi-turn trajectory
        (:mod:`tidal.envs`): the FINAL assistant turn's text.
    prompt_ids / response_ids: token ids of each part (multi-turn: the final turn's sampled ids).
    reference: the data row's reference answer (any JSON value), or None.
    label: the data row's recipe label (selects reward components), "" when the row has none.
    metadata: the rest of the data row.
    finish_reason: "stop" (EOS/stop token) or "length" (truncated at max_new_tokens).
    index: position of this sample in the scored batch (for error messages).
    messages: the whole conversation as chat messages, or None (a single-turn rollout that did not
        come through an environment): the row's messages, then each ``assistant`` turn (its decoded
        text, tool-call blocks and reasoning included) and the environment's observations (``tool``
        / ``user`` messages), in order. Rules that score the answer keep reading ``response``;
        functions that judge the whole interaction read this.
    """

    prompt: str
    response: str
    prompt_ids: list[int]
    response_ids: list[int]
    reference: Any = None
    label: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    finish_reason: str = "stop"
    index: int = 0
    messages: list[dict[str, Any]] | None = None


@dataclasses.dataclass(kw_only=True)
class RewardOutput:
    """Scores of a batch of B samples.

    total_B: weighted total reward (fp32). components: each named component's score [B].
    valid_B: False for samples dropped by a configured, counted skip (their total is 0 and must be
        excluded from training). metrics: scalar summaries (component means, counts of skips).
    component_masks: each component's bool [B], True where it produced a score (False where the
        sample's recipe does not use it or it failed); ``components[c]`` is 0 where this is False.
    """

    total_B: torch.Tensor
    components: dict[str, torch.Tensor]
    valid_B: torch.Tensor
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    component_masks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
