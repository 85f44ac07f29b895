"""The data check before a run (tidal.data.check, RewardConfig.check_row): which rows are sampled,
and what a rule component's reference check catches. The CLI's one-line errors for each mistake are
in tests/faults/test_bad_inputs.py and tests/unit/test_cli_check.py."""

import pytest

from tidal.config_base import ConfigError, build
from tidal.data.check import HEAD_ROWS, SPREAD_ROWS, sample_indices
from tidal.rewards.config import RewardConfig


def test_the_sample_is_the_head_and_evenly_spread_rows():
    assert sample_indices(5) == [0, 1, 2, 3, 4]
    assert sample_indices(HEAD_ROWS + SPREAD_ROWS) == list(range(HEAD_ROWS + SPREAD_ROWS))
    big = sample_indices(100_000)
    assert big[:HEAD_ROWS] == list(range(HEAD_ROWS)) and big[-1] == 99_999 and len(big) == HEAD_ROWS + SPREAD_ROWS
    assert big == sorted(set(big))


def _reward(**component) -> RewardConfig:
    return build(RewardConfig, {"components": {"answer": {"type": "math_answer", **component}}, "recipes": {"gsm8k": [["answer", 1.0]]}})


@pytest.mark.parametrize("reference", ["42", 42, "Tom has ... #### 1,234", "\\boxed{\\frac{1}{2}}", ["3", "three"]])
def test_math_answer_reads_these_references(reference):
    _reward().check_row("a.jsonl:1", "gsm8k", reference)


@pytest.mark.parametrize("reference", [None, "", True, [], float("nan")])
def test_math_answer_cannot_read_these(reference):
    with pytest.raises(ConfigError, match=r"a.jsonl:1: math_answer reads no answer from the reference") as e:
        _reward().check_row("a.jsonl:1", "gsm8k", reference)
    assert e.value.key == "reward.components.answer"


def test_labels_against_recipes():
    cfg = _reward()
    cfg.check_row("a.jsonl:1", "", "1")  # the only recipe is the default
    with pytest.raises(ConfigError, match=r"a.jsonl:2: the row has label 'math', which is not a recipe; recipes: \['gsm8k'\]; rename") as e:
        cfg.check_row("a.jsonl:2", "math", "1")
    assert e.value.key == "reward.recipes"
    two = build(RewardConfig, {"components": {"a": {"type": "math_answer"}}, "recipes": {"x": [["a", 1.0]], "y": [["a", 1.0]]}})
    with pytest.raises(ConfigError, match=r"has no label.*set reward.default_recipe"):
        two.check_row("a.jsonl:3", "", "1")
    RewardConfig().check_row("a.jsonl:1", "anything", None)  # no components: nothing to check
