"""The quickstart reward: exact integer answer, scored on the response only."""

import pytest

from tidal.rewards.types import RewardSample
from tidal.tasks.quickstart import arithmetic_reward


def _sample(response, reference="122", prompt="Calculate 37+85"):
    return RewardSample(prompt=prompt, response=response, prompt_ids=[], response_ids=[], reference=reference, label="arithmetic")


@pytest.mark.parametrize(
    "response,score",
    [("122", 1.0), ("  122\n", 1.0), ("122 is the answer", 1.0), ("0122", 1.0), ("121", 0.0), ("1220", 0.0), ("12 2", 0.0), ("", 0.0), ("-122", 0.0)],
)
def test_hand_checked(response, score):
    assert arithmetic_reward(_sample(response)) == score


def test_negative_reference():
    assert arithmetic_reward(_sample("-48", reference="-48")) == 1.0
    assert arithmetic_reward(_sample("48", reference="-48")) == 0.0


def test_prompt_is_not_scored():
    # the prompt holds 122 (as if echoed); an empty or wrong response still scores 0
    assert arithmetic_reward(_sample("", prompt="Calculate 100+22 = 122")) == 0.0
    assert arithmetic_reward(_sample("7", prompt="122")) == 0.0


def test_bad_reference_is_an_error_not_a_zero():
    with pytest.raises(ValueError):
        arithmetic_reward(_sample("122", reference="one hundred"))
