"""Rule rewards: answer extraction, math equivalence, the think/answer format, the length penalty."""

import pytest

from tidal.rewards import math_answer as ma
from tidal.rewards.rules import RULES, LengthPenaltyConfig, MathAnswerConfig, ThinkAnswerFormatConfig
from tidal.rewards.types import RewardSample


def sample(response, reference=None, n_tokens=0, prompt="What is 6*3? #### 99 \\boxed{99}"):
    # The prompt carries a wrong answer on purpose: rules must never look at it.
    return RewardSample(prompt=prompt, response=response, prompt_ids=[1, 2], response_ids=list(range(n_tokens)), reference=reference)


def rule(name, **kw):
    cls = RULES.get(name, "t")
    return cls(cls.Config(**kw))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{18}.", "18"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{unbalanced", None),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234.", "1234"),
        ("<think>hmm 5</think><answer> 12 </answer>", "12"),
        ("the answer is 12", None),
    ],
)
def test_response_answer(text, expected):
    assert ma.response_answer(text) == expected


def test_fallback_last_number_only_when_enabled():
    assert ma.response_answer("I get 3, then 1,024 apples") is None
    assert ma.response_answer("I get 3, then 1,024 apples", fallback_last_number=True) == "1024"


@pytest.mark.parametrize(
    "reference, expected",
    [
        ("He pays 10 + 8 = 18.\n#### 18", ["18"]),
        ("so $\\boxed{\\frac{3}{4}}$", ["\\frac{3}{4}"]),
        (" 42 ", ["42"]),
        (42, ["42"]),
        (0.5, ["0.5"]),
        (["#### 3", "three"], ["3", "three"]),
        (None, []),
        (True, []),
    ],
)
def test_reference_answers(reference, expected):
    assert ma.reference_answers(reference) == expected


@pytest.mark.parametrize(
    "gold, pred, same",
    [
        ("72", "72.0", True),
        ("1000", "1,000", True),
        ("18", "17", False),
        ("\\frac{1}{2}", "0.5", True),
        ("\\frac{1}{2}", "1/2", True),
        ("x+1", "1+x", True),
        ("\\sqrt{2}", "2^{1/2}", True),
        ("3", "\\pi", False),
    ],
)
def test_answers_match(gold, pred, same):
    assert ma.answers_match(gold, pred) is same


def test_math_answer_rule_gsm8k_and_boxed():
    r = rule("math_answer")
    gsm_ref = "Weng earns 12/60 = $0.2 per minute.\n#### 10"
    assert r.score(sample("Working: 0.2*50 = 10\n#### 10", gsm_ref)) == 1.0
    assert r.score(sample("The answer is \\boxed{10}", gsm_ref)) == 1.0
    assert r.score(sample("The answer is \\boxed{11}", gsm_ref)) == 0.0
    assert r.score(sample("no final answer, maybe 10", gsm_ref)) == 0.0  # strict: no marked answer
    assert r.score(sample("\\boxed{10}", None)) == 0.0  # no reference: cannot be right
    # The prompt's "#### 99" and "\boxed{99}" are never read:
    assert r.score(sample("\\boxed{10}", "#### 99")) == 0.0
    custom = rule("math_answer", correct=2.0, incorrect=-1.0, fallback_last_number=True)
    assert custom.score(sample("maybe 10", gsm_ref)) == 2.0
    assert custom.score(sample("maybe 9", gsm_ref)) == -1.0


def test_math_answer_rule_symbolic_reference():
    r = rule("math_answer")
    assert r.score(sample("so $\\boxed{0.75}$", "$\\boxed{\\frac{3}{4}}$")) == 1.0
    assert r.score(sample("so $\\boxed{\\frac{6}{8}}$", "\\frac{3}{4}")) == 1.0
    assert r.score(sample("so $\\boxed{\\frac{5}{8}}$", "\\frac{3}{4}")) == 0.0


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>6*3 is 18</think><answer>18</answer>", 1.0),
        ("  <think>a\nb</think>\n\n<answer>18</answer>\n", 1.0),
        ("<answer>18</answer>", 0.0),
        ("<think>x</think>", 0.0),
        ("<think>x</think><answer>18</answer> trailing", 0.0),
        ("intro <think>x</think><answer>18</answer>", 0.0),
        ("<think>x</think><answer>1</answer><answer>2</answer>", 0.0),
        ("<think><think>x</think></think><answer>1</answer>", 0.0),
        ("<answer>18</answer><think>x</think>", 0.0),
    ],
)
def test_think_answer_format(response, expected):
    # The prompt below is itself a perfectly formatted exchange; only the response is judged.
    s = sample(response)
    s.prompt = "<think>p</think><answer>p</answer>"
    assert rule("think_answer_format").score(s) == expected


def test_think_answer_format_options():
    r = rule("think_answer_format", think_tag="reasoning", answer_tag="final", require_think=False, matched=0.5, unmatched=-0.5)
    assert r.score(sample("<final>3</final>")) == 0.5
    assert r.score(sample("<reasoning>r</reasoning> <final>3</final>")) == 0.5
    assert r.score(sample("<think>r</think><answer>3</answer>")) == -0.5


@pytest.mark.parametrize("n, expected", [(0, 0.0), (32, 0.0), (40, -0.25), (48, -0.5), (64, -1.0), (100, -1.0)])
def test_length_penalty(n, expected):
    r = rule("length_penalty", max_tokens=64, target_tokens=32)
    assert r.score(sample("x", n_tokens=n)) == pytest.approx(expected)


def test_length_penalty_scale_from_zero():
    r = rule("length_penalty", max_tokens=10, penalty=0.2)  # target 0: -0.2 * L/10
    assert r.score(sample("x", n_tokens=5)) == pytest.approx(-0.1)


def test_rule_configs_validate():
    with pytest.raises(ValueError):
        MathAnswerConfig(timeout_s=0)
    with pytest.raises(ValueError):
        ThinkAnswerFormatConfig(think_tag="a b")
    with pytest.raises(ValueError):
        LengthPenaltyConfig(max_tokens=10, penalty=-1)


def test_math_answer_works_off_the_main_thread():
    # math-verify's own timer is signal-based (main thread only); elsewhere it must still answer
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(ma.answers_match("\\frac{1}{2}", "0.5")))
    t.start()
    t.join(30)
    assert out == [True]
