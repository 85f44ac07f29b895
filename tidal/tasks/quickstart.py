"""The quickstart task's reward, referenced from configs as ``tidal.tasks.quickstart:arithmetic_reward``."""

from __future__ import annotations

from tidal.rewards.types import RewardSample
from tidal.tasks.arithmetic import is_correct


def arithmetic_reward(sample: RewardSample) -> float:
    """1.0 if the response's answer equals the reference integer, else 0.0.

    Rule (scored on ``sample.response`` only, never the prompt): the answer is the first integer in
    the response, an optional ``+``/``-`` sign followed by digits; surrounding whitespace and any text
    after it are ignored (``" 122\\n"`` and ``"122 ok"`` score 1 against ``"122"``), and it is compared
    as an integer (``"0122"`` == ``"122"``). A response with no integer scores 0. A reference that is
    not an integer raises ``ValueError`` (a data error, not a wrong answer).
    """
    return 1.0 if is_correct(sample.response, sample.reference) else 0.0
