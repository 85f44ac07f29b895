"""Rule rewards: deterministic scores computed from the response (and the reference) in-process.

Each rule is a small registered class with its own kw-only ``Config``; ``score(sample)`` sees the
response text / ids, the reference and metadata, and never the prompt mixed into the response.
Rules do not raise on bad model output: an answer that cannot be found or parsed is a wrong answer.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import re
from typing import Literal

from tidal.config_base import check, check_choice
from tidal.registry import Registry
from tidal.rewards import math_answer
from tidal.rewards.base import ComponentResult, SyncComponent, as_score, cut_message
from tidal.rewards.types import RewardSample


class RuleReward(abc.ABC):
    """A rule. ``Config`` is its settings dataclass (the keys next to ``type`` in the YAML).
    ``needs_main_thread``: its own time limit works only on the main thread (so it is never
    scored in the background while decoding: :mod:`tidal.rewards.stream`).

    reads_answers: whether the rule reads an answer out of the response; such a rule says which
        responses it could not read (:meth:`unparsed`, the ``reward/<name>/unparsed_frac`` metric)
        and which references it cannot use (:meth:`reference_problem`, checked before a run starts).
    """

    Config: type = object
    needs_main_thread: bool = False
    reads_answers: bool = False

    def __init__(self, cfg):
        self.cfg = cfg

    @abc.abstractmethod
    def score(self, sample: RewardSample) -> float:
        """The reward of one sample (a finite float)."""

    def unparsed(self, sample: RewardSample) -> bool:
        """True when the response holds no answer this rule can read (then it scored it wrong)."""
        return False

    def reference_problem(self, reference) -> str | None:
        """Why this rule cannot score responses against ``reference`` (a data row's reference):
        it cannot read an answer from it, or a well-formed answer to it is not scored right; None
        when it can."""
        return None


RULES: Registry[RuleReward] = Registry("reward rule")


@dataclasses.dataclass(kw_only=True)
class MathAnswerConfig:
    """correct / incorrect: rewards of a right / wrong (or missing) answer.
    fallback_last_number: when the response has no ``\\boxed{}``, ``####`` or ``<answer>`` answer,
        take its last number (GSM8K "flexible" extraction); off means such a response is wrong.
    timeout_s: math-verify's own parse/compare time limit (applied when scoring on the main thread,
        where its signal-based timer works; elsewhere no limit applies)."""

    correct: float = 1.0
    incorrect: float = 0.0
    fallback_last_number: bool = False
    timeout_s: int = 5

    def __post_init__(self):
        check(self.timeout_s >= 1, "timeout_s", "must be >= 1 (seconds, integer)")


@RULES.register("math_answer")
class MathAnswer(RuleReward):
    """Final-answer verification: the response's answer (last ``\\boxed{}``, else ``#### x``, else
    ``<answer>x</answer>``) against the reference (a GSM8K solution ending in ``#### x``, a
    ``\\boxed{}`` solution, a bare answer, a number, or a list of acceptable answers), compared
    numerically and then symbolically with math-verify."""

    Config = MathAnswerConfig
    needs_main_thread = True  # math-verify's timeout is a signal timer
    reads_answers = True

    def score(self, sample: RewardSample) -> float:
        golds = math_answer.reference_answers(sample.reference)
        pred = math_answer.response_answer(sample.response, fallback_last_number=self.cfg.fallback_last_number)
        if pred is None or not golds:
            return self.cfg.incorrect
        ok = any(math_answer.answers_match(g, pred, timeout_s=self.cfg.timeout_s) for g in golds)
        return self.cfg.correct if ok else self.cfg.incorrect

    def unparsed(self, sample: RewardSample) -> bool:
        return math_answer.response_answer(sample.response, fallback_last_number=self.cfg.fallback_last_number) is None

    def reference_problem(self, reference) -> str | None:
        golds = math_answer.reference_answers(reference)
        if not golds:
            return (f"math_answer reads no answer from the reference {reference!r:.80}: give a number, a bare answer, a "
                    "GSM8K solution ending in '#### x', a \\boxed{} solution or a list of these (data.reference_key names the field)")
        if self.cfg.correct == self.cfg.incorrect:
            return None
        answer = f"The answer is \\boxed{{{golds[0]}}}."
        if self.score(RewardSample(prompt="", response=answer, prompt_ids=[], response_ids=[], reference=reference)) != self.cfg.correct:
            return f"math_answer does not score the well-formed answer {answer!r:.80} right against the reference {reference!r:.80}"
        return None


@dataclasses.dataclass(kw_only=True)
class ThinkAnswerFormatConfig:
    """The response must be exactly ``<think>...</think>`` then ``<answer>...</answer>`` (whitespace
    around them allowed, one of each, nothing else). think_tag / answer_tag: the tag names;
    require_think: off accepts a response that is only the answer block. matched / unmatched: rewards."""

    think_tag: str = "think"
    answer_tag: str = "answer"
    require_think: bool = True
    matched: float = 1.0
    unmatched: float = 0.0

    def __post_init__(self):
        for name in ("think_tag", "answer_tag"):
            check(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", getattr(self, name))), name, "must be a tag name")


@RULES.register("think_answer_format")
class ThinkAnswerFormat(RuleReward):
    """Template check on the response only."""

    Config = ThinkAnswerFormatConfig

    def __init__(self, cfg: ThinkAnswerFormatConfig):
        super().__init__(cfg)
        t, a = re.escape(cfg.think_tag), re.escape(cfg.answer_tag)
        think = rf"<{t}>(?:(?!</?{t}>).)*</{t}>\s*"
        answer = rf"<{a}>(?:(?!</?{a}>).)*</{a}>"
        self._re = re.compile(rf"\s*{think if cfg.require_think else f'(?:{think})?'}{answer}\s*", re.DOTALL)

    def score(self, sample: RewardSample) -> float:
        return self.cfg.matched if self._re.fullmatch(sample.response) else self.cfg.unmatched


@dataclasses.dataclass(kw_only=True)
class LengthPenaltyConfig:
    """Linear penalty on the response length L (tokens): 0 while L <= target_tokens, falling to
    ``-penalty`` at L = max_tokens and staying there (DAPO's soft overlong punishment when
    target_tokens = max_new_tokens - buffer)."""

    max_tokens: int
    target_tokens: int = 0
    penalty: float = 1.0

    def __post_init__(self):
        check(self.target_tokens >= 0, "target_tokens", "must be >= 0")
        check(self.max_tokens > self.target_tokens, "max_tokens", "must be > target_tokens")
        check(self.penalty >= 0, "penalty", "must be >= 0 (the score is -penalty at worst)")


@RULES.register("length_penalty")
class LengthPenalty(RuleReward):
    """score = -penalty * clip((L - target) / (max - target), 0, 1) with L = len(response_ids)."""

    Config = LengthPenaltyConfig

    def score(self, sample: RewardSample) -> float:
        c = self.cfg
        frac = (len(sample.response_ids) - c.target_tokens) / (c.max_tokens - c.target_tokens)
        return 0.0 - c.penalty * min(1.0, max(0.0, frac))


@dataclasses.dataclass(kw_only=True)
class ReasoningGymRewardConfig:
    """answer: how the answer is read from the response: ``tag``, the library's own extraction
    (``reasoning_gym.utils.extract_answer``: the last ``<tag>...</tag>`` block, stripped; none is a
    wrong answer); ``whole``: the whole response, stripped (for a model that answers bare).
    tag: the tag of ``answer: tag``. The score is the dataset's own ``score_answer`` (0..1)."""

    answer: Literal["tag", "whole"] = "tag"
    tag: str = "answer"

    def __post_init__(self):
        check_choice(self.answer, ("tag", "whole"), "answer")
        check(bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", self.tag)), "tag", "must be a tag name")


@RULES.register("reasoning_gym")
class ReasoningGymReward(RuleReward):
    """A reasoning-gym row's score: its dataset's own ``score_answer(answer, entry)`` (the dataset
    built with the row's settings), on the answer read from the response (``answer``). The row comes
    from a ``reasoning_gym`` data source (:mod:`tidal.tasks.reasoning_gym`), whose field
    ``reasoning_gym`` holds the dataset name, its settings and the library's entry."""

    Config = ReasoningGymRewardConfig
    reads_answers = True

    def __init__(self, cfg: ReasoningGymRewardConfig):
        super().__init__(cfg)
        self._datasets: dict[str, object] = {}

    def _answer(self, response: str) -> str | None:
        if self.cfg.answer == "whole":
            return response.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(response, tag_name=self.cfg.tag)

    def _dataset(self, name: str, config: dict):
        key = json.dumps([name, config], sort_keys=True)
        if key not in self._datasets:
            from reasoning_gym.factory import DATASETS

            dataset_cls, config_cls = DATASETS[name]
            self._datasets[key] = dataset_cls(config=config_cls(**config))
        return self._datasets[key]

    def score(self, sample: RewardSample) -> float:
        record = sample.metadata.get("reasoning_gym")
        if not isinstance(record, dict) or not {"dataset", "config", "entry"} <= record.keys():
            raise ValueError("the row has no 'reasoning_gym' field {dataset, config, entry}: the rule scores rows of a "
                             "reasoning_gym data source (data.train[i].reasoning_gym)")
        dataset = self._dataset(record["dataset"], record["config"])
        return float(dataset.score_answer(self._answer(sample.response), record["entry"]))

    def unparsed(self, sample: RewardSample) -> bool:
        return self._answer(sample.response) is None


class RuleComponent(SyncComponent):
    """A rule as a reward component (scored inline; rules are cheap and do not block). A rule that
    reads answers also reports which responses it could not read (``ComponentResult.unparsed``)."""

    def __init__(self, rule: RuleReward):
        self.rule = rule
        self.streams = not rule.needs_main_thread  # a stream scores in a background thread
        self.reads_answers = rule.reads_answers

    def score(self, samples: list[RewardSample]) -> ComponentResult:
        result = ComponentResult(scores=[], unparsed=set() if self.rule.reads_answers else None)
        for i, s in enumerate(samples):
            try:
                result.scores.append(as_score(self.rule.score(s)))
                if result.unparsed is not None and self.rule.unparsed(s):
                    result.unparsed.add(i)
            except Exception as e:  # a rule bug is reported per sample like any component error
                result.scores.append(math.nan)
                result.errors[i] = cut_message(f"rule '{self.rule.name}' raised {type(e).__name__}: {e}")
        return result
