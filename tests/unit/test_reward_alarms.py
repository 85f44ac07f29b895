"""Rewards say when they cannot read answers (reward/<name>/unparsed_frac) and the run warns when its
rewards teach nothing (tidal.rewards.alarms); the console's headline reward is the trained one."""

import json
import math

import pytest
import torch

from tidal.config import load_config
from tidal.config_base import build
from tidal.logging.console import step_line
from tidal.rewards import RewardConfig, RewardEngine, RewardSample
from tidal.rewards.alarms import RewardAlarms, all_equal_warning, unparsed_warnings


def S(response, reference="4", label=""):
    return RewardSample(prompt="Q", response=response, prompt_ids=[1], response_ids=[2], reference=reference, label=label)


def _engine(components, recipes):
    return RewardEngine(build(RewardConfig, {"components": components, "recipes": recipes}), device=torch.device("cpu"))


def test_math_answer_counts_the_responses_it_cannot_read():
    eng = _engine({"answer": {"type": "math_answer"}, "fmt": {"type": "think_answer_format"}},
                  {"math": [["answer", 1.0]], "fmt": [["fmt", 1.0]]})
    batch = [S("4", label="math"), S("#### 4", label="math"), S("the answer is 5", label="math"), S("\\boxed{3}", label="math"),
             S("4", label="fmt")]  # the last one's recipe does not use `answer`: not counted
    out = eng.score(batch)
    assert out.components["answer"].tolist()[:4] == [0.0, 1.0, 0.0, 0.0]
    assert out.metrics["reward/answer/unparsed_frac"] == 0.5 and out.metrics["reward/answer/unparsed_frac/count"] == 4.0
    assert "reward/fmt/unparsed_frac" not in out.metrics  # a format rule reads no answer
    only_fmt = eng.score([S("4", label="fmt")])  # the same keys when `answer` scored nothing here (ranks agree on keys)
    assert math.isnan(only_fmt.metrics["reward/answer/unparsed_frac"]) and only_fmt.metrics["reward/answer/unparsed_frac/count"] == 0.0
    eng.close()
    fallback = _engine({"answer": {"type": "math_answer", "fallback_last_number": True}}, {"math": [["answer", 1.0]]})
    out = fallback.score([S("4"), S("the answer is 5"), S("no number")])
    assert out.metrics["reward/answer/unparsed_frac"] == pytest.approx(1 / 3)
    fallback.close()


def test_unparsed_and_all_equal_messages():
    found = unparsed_warnings({"reward/answer/unparsed_frac": 1.0, "reward/other/unparsed_frac": 0.5,
                               "reward/nan/unparsed_frac": math.nan, "eval/reward/x/unparsed_frac": 0.9})
    assert list(found) == ["answer"] and "'answer' found no answer it can read in 100% of the responses" in found["answer"]
    assert list(unparsed_warnings({"eval/reward/x/unparsed_frac": 0.9}, prefix="eval/")) == ["x"]
    assert "every reward of x is 0" in all_equal_warning(0.0, 0.0, "of x")
    assert all_equal_warning(0.0, 1.0, "x") is None and all_equal_warning(math.inf, -math.inf, "x") is None


def test_alarms_fire_at_the_1st_2nd_4th_8th_step_and_track_the_whole_run():
    alarms = RewardAlarms()
    zero = {"reward/trajectory_min": 0.0, "reward/trajectory_max": 0.0, "reward/a/unparsed_frac": 1.0}
    printed = [len(alarms.step(zero)) for _ in range(9)]
    assert printed == [1, 1, 0, 2, 0, 0, 0, 2, 0]  # unparsed at steps 1, 2, 4, 8; all-equal at 4 and 8 (evidence)
    alarms.step({"reward/trajectory_min": 0.0, "reward/trajectory_max": 1.0, "reward/a/unparsed_frac": 0.1})
    later = RewardAlarms()
    later.step({"reward/trajectory_min": 0.0, "reward/trajectory_max": 1.0})
    assert later.step({"reward/trajectory_min": 1.0, "reward/trajectory_max": 1.0}) == []  # the run's rewards differ
    quiet = RewardAlarms(all_equal=False)  # a run that learns from a distillation teacher
    assert quiet.step({"reward/trajectory_min": 0.0, "reward/trajectory_max": 0.0}) == []
    start = RewardAlarms().start_eval({"eval/greedy_reward_min": 0.0, "eval/greedy_reward_max": 0.0, "eval/reward/a/unparsed_frac": 1.0})
    assert len(start) == 1 and "'a' found no answer it can read" in start[0]


def test_a_task_that_starts_at_zero_by_design_is_not_warned_until_the_evidence_is_there():
    """The shipped calculator starts at greedy accuracy 0 and learns from rare sampled successes
    (issue 44 item 13): no warning at the start-of-run evaluation or in the first steps; a run that
    stays at 0 is warned from its 4th step."""
    alarms = RewardAlarms()
    assert alarms.start_eval({"eval/greedy_reward_min": 0.0, "eval/greedy_reward_max": 0.0}) == []
    zero = {"reward/trajectory_min": 0.0, "reward/trajectory_max": 0.0}
    assert [alarms.step(zero) for _ in range(3)] == [[], [], []]
    assert alarms.step(zero) == [all_equal_warning(0.0, 0.0, "of the run so far (4 steps)")]
    learns = RewardAlarms()
    assert [learns.step(m) for m in (zero, zero, {"reward/trajectory_min": 0.0, "reward/trajectory_max": 1.0}, zero)] == [[]] * 4


def test_the_headline_reward_is_the_trained_reward():
    """An environment's outcome reward is in reward/mean, not in the components' reward/total."""
    assert "reward 0.47" in step_line(1, 10, {"reward/total": 0.0, "reward/mean": 0.47})


def test_a_run_whose_reward_reads_no_answer_warns(tmp_path, tiny_task_overrides, capsys):
    """math_answer on the quickstart's bare-number answers: reward 0 for the whole run, now with warnings."""
    from tidal.build import build_trainer
    from tidal.distributed import shutdown

    out = tmp_path / "run"
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={out}", "run.steps=4", "reward.components.correct={type: math_answer}", "eval.at_start=true",
        "checkpoint.every=0", "checkpoint.at_end=false"])
    try:
        trainer = build_trainer(cfg)
        assert trainer.maker.env.max_context == 128  # trajectories end where the tiny model's context does
        trainer.fit()
    finally:
        shutdown()
    text = capsys.readouterr().out
    assert text.count("reward component 'correct' found no answer it can read in 100% of the responses (eval/reward/correct/unparsed_frac)") == 1
    assert text.count("reward component 'correct' found no answer it can read in 100% of the responses (reward/correct/unparsed_frac)") == 3
    assert "start-of-run evaluation (greedy)" not in text and "every reward of the run so far (4 steps) is 0" in text
    assert "run so far (2 steps)" not in text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/correct/unparsed_frac"] for r in rows if r["step"] > 0] == [1.0] * 4
    assert rows[0]["eval/reward/correct/unparsed_frac"] == 1.0
