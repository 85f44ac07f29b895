"""Final-answer extraction and comparison for math rewards.

Extraction finds WHERE the answer is (``\\boxed{}``, GSM8K ``#### x``, ``<answer>x</answer>``);
comparison decides whether two answers are EQUAL: numbers are compared numerically first, then
both sides go through math-verify (LaTeX/sympy parsing and symbolic equivalence). When math-verify
cannot parse either side, normalised strings are compared.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any

_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED_OPENERS = ("\\boxed{", "\\fbox{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces balanced), or None."""
    start = max(text.rfind(op) for op in _BOXED_OPENERS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
        j += 1
    return None  # unbalanced: no answer


def gsm8k_answer(text: str) -> str | None:
    """The text after the last ``####`` (GSM8K's answer marker), commas and a final period removed."""
    found = _GSM8K_RE.findall(text)
    if not found:
        return None
    ans = found[-1].strip().rstrip(".").replace(",", "").strip()
    return ans or None


def answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG_RE.findall(text)
    return found[-1].strip() or None if found else None


def last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def response_answer(response: str, *, fallback_last_number: bool = False) -> str | None:
    """The answer a response gives: last ``\\boxed{}``, else ``#### x``, else ``<answer>``, else
    (only with ``fallback_last_number``) the last number; None when there is none."""
    for extract in (last_boxed, gsm8k_answer, answer_tag):
        ans = extract(response)
        if ans:
            return ans
    return last_number(response) if fallback_last_number else None


def reference_answers(reference: Any) -> list[str]:
    """Acceptable answers from a data row's reference: a number, a bare answer, a GSM8K solution
    (``... #### 42``), a ``\\boxed{}`` solution, or a list of any of these."""
    if reference is None or isinstance(reference, bool):
        return []
    if isinstance(reference, (list, tuple)):
        return [a for r in reference for a in reference_answers(r)]
    if isinstance(reference, (int, float)):
        return [repr(reference)] if math.isfinite(reference) else []
    text = str(reference)
    ans = gsm8k_answer(text) if "####" in text else last_boxed(text) or text.strip()
    return [ans] if ans else []


def _as_number(text: str) -> float | None:
    t = text.strip().strip("$").replace(",", "").rstrip("%").strip()
    try:
        value = float(t)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$").rstrip(".")).lower()


def answers_match(gold: str, pred: str, *, timeout_s: int = 5) -> bool:
    """True when ``pred`` is the same answer as ``gold``."""
    g, p = _as_number(gold), _as_number(pred)
    if g is not None and p is not None:
        return abs(g - p) <= 1e-6 * max(1.0, abs(g))
    verdict = _math_verify(gold, pred, timeout_s)
    return verdict if verdict is not None else _normalise(gold) == _normalise(pred)


def _math_verify(gold: str, pred: str, timeout_s: int) -> bool | None:
    """math-verify's verdict, or None when it cannot parse one side (or is not installed)."""
    try:
        from math_verify import parse, verify
    except ImportError:  # optional: numeric and string comparison still work
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" warning is handled here
    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    g = parse(f"${gold}$", parsing_timeout=t)
    p = parse(f"${pred}$", parsing_timeout=t)
    if not g or not p:
        return None
    return bool(verify(g, p, timeout_seconds=t))
