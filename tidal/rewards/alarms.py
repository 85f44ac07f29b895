"""Warnings for rewards that teach nothing: a run whose rewards are all equal, or a component that
cannot read most answers (docs/rewards.md#rewards-that-teach-nothing).

Read from metrics already combined over ranks, so every rank decides the same and rank 0 prints:

- **mostly unparsed**: ``reward/<name>/unparsed_frac`` above :data:`UNPARSED_ALARM` (more than
  half the responses scored hold no answer the component can read; it scores them as wrong);
- **all equal**: every reward of the run so far is the same number (``reward/trajectory_min`` ==
  ``reward/trajectory_max`` over all steps): the reward carries no signal (group-relative
  advantages are 0). Warned on evidence only: from the :data:`EQUAL_ALARM_STEPS`-th step of such a
  run on (a task may start at reward 0 by design, as the calculator does, and learn from its
  first rare successes), never from the start-of-run evaluation (its greedy answers are one per
  prompt; training samples many). Not warned when the run learns from a distillation teacher.

At the start-of-run evaluation the unparsed answers are read from its ``eval/`` metrics. A
condition that persists is printed at its 1st, 2nd, 4th, 8th... step (all equal: at the 4th, 8th,
16th... step of the run), not at every step.
"""

from __future__ import annotations

import math

UNPARSED_ALARM = 0.5
EQUAL_ALARM_STEPS = 4  # steps whose rewards are all one number before that says the reward carries no signal
DOCS = "docs/rewards.md#rewards-that-teach-nothing"


def unparsed_warnings(metrics: dict[str, float], *, prefix: str = "") -> dict[str, str]:
    """``{component: message}`` for each component of ``metrics`` (keys ``{prefix}reward/<name>/unparsed_frac``)
    that could not read more than :data:`UNPARSED_ALARM` of the answers it scored."""
    out = {}
    head, tail = f"{prefix}reward/", "/unparsed_frac"
    for key, frac in metrics.items():
        if key.startswith(head) and key.endswith(tail) and not math.isnan(frac) and frac > UNPARSED_ALARM:
            name = key[len(head):-len(tail)]
            out[name] = (f"reward component '{name}' found no answer it can read in {frac:.0%} of the responses "
                         f"({key}) and scored them as wrong: prompt for the format it reads, or change the "
                         f"component (see {DOCS})")
    return out


def all_equal_warning(low: float, high: float, what: str) -> str | None:
    """The message when every reward in ``[low, high]`` is one number (None otherwise or when unknown)."""
    if not (math.isfinite(low) and math.isfinite(high)) or low != high:
        return None
    return (f"every reward {what} is {low:g}: it carries no signal and nothing is learned from it; check the "
            f"reward components against the responses and the data's references (see {DOCS})")


class RewardAlarms:
    """The run's reward warnings (see the module docstring); ``step`` and ``start_eval`` return the
    lines to print now. ``all_equal``: whether equal rewards are worth a warning (not in a run that
    learns from a distillation teacher, or has no reward components)."""

    def __init__(self, *, all_equal: bool = True):
        self.all_equal = all_equal
        self.low, self.high, self.steps = math.inf, -math.inf, 0
        self.fired: dict[str, int] = {}

    def start_eval(self, metrics: dict[str, float]) -> list[str]:
        """Warnings of the start-of-run evaluation (its ``eval/`` metrics, combined over ranks):
        components that cannot read the answers. Equal greedy rewards are no evidence (see the module
        docstring)."""
        return list(unparsed_warnings(metrics, prefix="eval/").values())

    def step(self, metrics: dict[str, float]) -> list[str]:
        """Warnings after a training step (its metrics, combined over ranks)."""
        self.steps += 1
        self.low = min(self.low, metrics.get("reward/trajectory_min", math.inf))
        self.high = max(self.high, metrics.get("reward/trajectory_max", -math.inf))
        found = dict(unparsed_warnings(metrics))
        lines = [message for key, message in found.items() if self._due(key)]
        equal = all_equal_warning(self.low, self.high, f"of the run so far ({self.steps} steps)")
        due = self.steps >= EQUAL_ALARM_STEPS and self.steps & (self.steps - 1) == 0  # the 4th, 8th, 16th... step
        return lines + ([equal] if equal and self.all_equal and due else [])

    def _due(self, key: str) -> bool:
        """The 1st, 2nd, 4th, 8th... time ``key`` fires."""
        n = self.fired[key] = self.fired.get(key, 0) + 1
        return n & (n - 1) == 0
