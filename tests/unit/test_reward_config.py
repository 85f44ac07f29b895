"""RewardConfig validation: every error names its dotted key."""

import pytest
import yaml

from tidal.config_base import ConfigError, build, to_dict
from tidal.rewards.config import FunctionRewardConfig, RewardConfig
from tidal.rewards.rules import LengthPenaltyConfig, ThinkAnswerFormatConfig

YAML = """
reward:
  components:
    correct: {type: function, path: "tidal.tasks.quickstart:arithmetic_reward"}
    fmt: {type: rule, rule: think_answer_format}
    short: {type: length_penalty, max_tokens: 64, target_tokens: 32}
  recipes:
    default: [[correct, 1.0], [fmt, 0.1]]
    long: {correct: 1.0, short: 0.5}
"""


def _reward(data):
    return build(RewardConfig, data, prefix="reward")


def test_yaml_example_parses():
    cfg = _reward(yaml.safe_load(YAML)["reward"])
    assert cfg.specs["correct"].type == "function"
    assert cfg.specs["correct"].settings == FunctionRewardConfig(path="tidal.tasks.quickstart:arithmetic_reward")
    assert cfg.specs["fmt"].rule == "think_answer_format"
    assert cfg.specs["fmt"].settings == ThinkAnswerFormatConfig()
    # the shorthand {type: <rule>} is the same as {type: rule, rule: <rule>}
    assert cfg.specs["short"].type == "rule" and cfg.specs["short"].rule == "length_penalty"
    assert cfg.specs["short"].settings == LengthPenaltyConfig(max_tokens=64, target_tokens=32)
    assert cfg.recipe_weights == {"default": [("correct", 1.0), ("fmt", 0.1)], "long": [("correct", 1.0), ("short", 0.5)]}
    # round-trips through the plain-dict form
    assert _reward(to_dict(cfg)).recipe_weights == cfg.recipe_weights


def test_empty_config_is_valid_but_means_no_rewards():
    cfg = RewardConfig()
    assert cfg.specs == {} and cfg.recipe_weights == {}


@pytest.mark.parametrize(
    "data, key",
    [
        ({"components": {"a": {"type": "nope"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.type"),
        ({"components": {"a": {"rule": "math_answer"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.type"),
        ({"components": {"a": {"type": "rule", "rule": "nope"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.rule"),
        ({"components": {"a": {"type": "rule"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.rule"),
        ({"components": {"a": {"type": "function", "path": "m:f", "timeout_s": 0}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.timeout_s"),
        ({"components": {"a": {"type": "function"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a"),
        ({"components": {"a": {"type": "function", "path": "m:f", "bogus": 1}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.bogus"),
        ({"components": {"a": {"type": "math_answer", "correct": "yes"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.correct"),
        ({"components": {"a": {"type": "length_penalty", "max_tokens": 4, "target_tokens": 8}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.max_tokens"),
        ({"components": {"a": {"type": "remote", "url": "localhost:8000"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.url"),
        ({"components": {"a": {"type": "model", "path": "/x", "micro_batch_size": 0}}, "recipes": {"default": [["a", 1]]}}, "reward.components.a.micro_batch_size"),
        ({"components": {"total": {"type": "math_answer"}}, "recipes": {"default": [["total", 1]]}}, "reward.components.total"),
        ({"components": {"a b": {"type": "math_answer"}}, "recipes": {"default": [["a b", 1]]}}, "reward.components.a b"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"default": [["b", 1]]}}, "reward.recipes.default[0]"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"default": [["a", "x"]]}}, "reward.recipes.default[0]"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"default": [["a", 1], ["a", 2]]}}, "reward.recipes.default[1]"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"default": []}}, "reward.recipes.default"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"default": [["a", float("nan")]]}}, "reward.recipes.default[0]"),
        ({"components": {"a": {"type": "math_answer"}, "b": {"type": "math_answer"}}, "recipes": {"default": [["a", 1]]}}, "reward.components.b"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"math": [["a", 1]]}, "default_recipe": "default"}, "reward.default_recipe"),
        ({"components": {"a": {"type": "math_answer"}}}, "reward.recipes"),
        ({"recipes": {"default": [["a", 1]]}}, "reward.recipes"),
        ({"components": {"a": {"type": "math_answer"}}, "recipes": {"default": [["a", 1]]}, "on_error": "ignore"}, "reward.on_error"),
    ],
)
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        _reward(data)
    assert e.value.key == key


def test_labelled_only_data_may_disable_default_recipe():
    cfg = _reward({"components": {"a": {"type": "math_answer"}}, "recipes": {"math": [["a", 1]]}, "default_recipe": None})
    assert cfg.default_recipe is None


@pytest.mark.parametrize("recipes, default, resolved", [
    ({"gsm8k": [["a", 1]]}, None, "gsm8k"),                       # the README's GSM8K config: the only recipe
    ({"default": [["a", 1]], "chat": [["a", 2]]}, None, "default"),  # the recipe named default
    ({"math": [["a", 1]], "chat": [["a", 2]]}, None, None),          # ambiguous: unlabelled rows are an error
    ({"math": [["a", 1]], "chat": [["a", 2]]}, "chat", "chat"),      # named
])
def test_default_recipe_resolves_without_breaking_a_single_recipe_config(recipes, default, resolved):
    cfg = _reward({"components": {"a": {"type": "math_answer"}}, "recipes": recipes, "default_recipe": default})
    assert cfg.unlabelled_recipe == resolved
