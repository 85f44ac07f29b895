"""The synthetic arithmetic task: problems, prompt rows, and the exact answer rule.

A problem is ``a <op> b`` with operands in ``[0, 10**digits)`` and ``op`` in ``+``/``-``. The prompt
(the user message; the chat template is applied by whoever tokenizes it) says what to do; the
reference is the exact integer result as a decimal string (``"-48"`` for 37-85).
"""

from __future__ import annotations

import dataclasses
import random
import re

LABEL = "arithmetic"
_INTEGER = re.compile(r"[-+]?\d+")


@dataclasses.dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int
    width: int = 0  # fixed-width format: operands zero-padded to `width` digits, answers to width + 1

    def format(self, value: int) -> str:
        """How an answer is written in demonstrations: ``-48`` or, fixed-width, ``-048``."""
        if not self.width:
            return str(value)
        return ("-" if value < 0 else "") + f"{abs(value):0{self.width + 1}d}"

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def prompt(self) -> str:
        return f"Calculate {self.a:0{self.width}d}{self.op}{self.b:0{self.width}d}"

    @property
    def mistaken_answer(self) -> int:
        """The classic slips: carries dropped (``37+85 -> 12``), or in subtraction each digit's smaller
        taken from its larger, which never borrows and never goes negative (``52-38 -> 26``,
        ``38-52 -> 26``, ``12-34 -> 22``). Equals ``answer`` exactly when no carry, borrow or sign
        is needed."""
        if self.op == "+":
            return _digitwise(self.a, self.b, lambda x, y: (x + y) % 10)
        return _digitwise(self.a, self.b, lambda x, y: abs(x - y))

    def row(self) -> dict:
        """The JSONL row the trainer reads: prompt, reference answer, reward label."""
        return {"prompt": self.prompt, "reference": str(self.answer), "label": LABEL}


def split_problems(
    *, digits: int, operations: list[str], num_train: int, num_eval: int, seed: int, fixed_width: bool = False
) -> tuple[list[Problem], list[Problem]]:
    """Draw ``num_train + num_eval`` distinct problems (without replacement, seeded) and split them
    into (train, eval); the two sets are disjoint by construction. Same arguments -> same lists."""
    base = 10**digits
    space = len(operations) * base * base
    if num_train + num_eval > space:
        raise ValueError(f"{num_train + num_eval} problems requested but only {space} exist")
    picks = random.Random(seed).sample(range(space), num_train + num_eval)
    problems = [_decode(i, base, operations, digits if fixed_width else 0) for i in picks]
    return problems[num_eval:], problems[:num_eval]


def _digitwise(a: int, b: int, digit_op) -> int:
    out, place = 0, 1
    while a or b:
        out += digit_op(a % 10, b % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def sft_rows(problems: list[Problem], *, mistake_rate: float, seed: int) -> list[dict]:
    """Supervised rows: each problem's reference is its answer written by :meth:`Problem.format` or,
    with probability ``mistake_rate`` (seeded), its :attr:`Problem.mistaken_answer`: imperfect
    demonstrations that RL with an exact reward can correct."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        slip = rng.random() < mistake_rate
        rows.append(dict(p.row(), reference=p.format(p.mistaken_answer if slip else p.answer)))
    return rows


def _decode(index: int, base: int, operations: list[str], width: int) -> Problem:
    op_index, rest = divmod(index, base * base)
    a, b = divmod(rest, base)
    return Problem(a=a, op=operations[op_index], b=b, width=width)


def extract_answer(response: str) -> int | None:
    """The response's answer: its first integer (optional sign, then digits), or None if it has none.

    ``"122"``, ``" 122\\n"``, ``"122 because..."`` -> 122; ``"-48"`` -> -48; ``"abc"`` -> None.
    """
    match = _INTEGER.search(response)
    return int(match.group()) if match else None


def is_correct(response: str, reference: str | int) -> bool:
    """True iff the response's first integer equals the reference integer (so ``"0122"`` == 122)."""
    answer = extract_answer(response)
    return answer is not None and answer == int(reference)
