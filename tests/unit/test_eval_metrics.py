"""Evaluation reports accuracy only when the rewards judge right or wrong (rules, functions); with a
reward model or a remote service among the components, the mean reward only."""

import pytest

from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.rewards.config import RewardConfig
from tidal.trainer.config import EvalConfig
from tidal.trainer.evaluate import EvalSums, eval_metrics

RULE = {"type": "math_answer"}
MODEL = {"type": "model", "path": "/rm"}


def test_judges_correctness_by_component_type():
    def cfg(**components):
        return RewardConfig(components=components, recipes={"default": {n: 1.0 for n in components}})

    assert cfg(acc=RULE).judges_correctness
    assert cfg(fn={"type": "function", "path": "tidal.tasks.quickstart:arithmetic_reward"}).judges_correctness
    assert not cfg(acc=RULE, rm=MODEL).judges_correctness
    assert not cfg(remote={"type": "remote", "url": "http://127.0.0.1:9"}).judges_correctness


def test_eval_metrics_by_hand():
    tot = EvalSums(prompts=4, greedy_reward=2.6, greedy_correct=2, sampled_reward=1.8, pass_at_k=3, greedy_length=40)
    cfg = EvalConfig(n_samples=4)
    judged = eval_metrics(tot, cfg, accuracy=True)
    assert judged == pytest.approx({"eval/prompts_count": 4, "eval/greedy_reward": 0.65, "eval/greedy_length": 10,
                                    "eval/greedy_accuracy": 0.5, "eval/mean@4": 0.45, "eval/pass@4": 0.75})
    scored = eval_metrics(tot, cfg, accuracy=False)  # a reward model: a score, no threshold
    assert scored == {k: v for k, v in judged.items() if k not in ("eval/greedy_accuracy", "eval/pass@4")}


def test_a_threshold_with_a_reward_model_is_a_config_error(tmp_path):
    rm = ["reward.components={rm: {type: model, path: /rm}}", "reward.recipes={default: {rm: 1.0}}"]
    assert load_config("quickstart", rm).eval.correct_threshold == 1.0  # the default is fine
    with pytest.raises(ConfigError, match="eval.correct_threshold"):
        load_config("quickstart", rm + ["eval.correct_threshold=0.5"])
