"""Synthetic arithmetic data: determinism, disjoint splits, hand-checked answers and slips."""

import pytest

from tidal.tasks.arithmetic import LABEL, Problem, extract_answer, is_correct, sft_rows, split_problems


def _split(seed=0, **kw):
    args = dict(digits=2, operations=["+", "-"], num_train=300, num_eval=50, seed=seed)
    args.update(kw)
    return split_problems(**args)


def test_split_is_deterministic_and_seeded():
    assert _split(seed=3) == _split(seed=3)
    assert _split(seed=3) != _split(seed=4)


def test_split_sizes_distinct_and_disjoint():
    train, held_out = _split()
    assert len(train) == 300 and len(held_out) == 50
    assert len(set(train)) == 300 and len(set(held_out)) == 50
    assert not set(train) & set(held_out)


def test_split_covers_whole_space_when_asked():
    train, held_out = split_problems(digits=1, operations=["+"], num_train=90, num_eval=10, seed=0)
    assert {(p.a, p.b) for p in train + held_out} == {(a, b) for a in range(10) for b in range(10)}
    with pytest.raises(ValueError):
        split_problems(digits=1, operations=["+"], num_train=91, num_eval=10, seed=0)


def test_operands_in_range_and_ops_used():
    train, _ = _split(num_train=2000)
    assert all(0 <= p.a < 100 and 0 <= p.b < 100 for p in train)
    assert {p.op for p in train} == {"+", "-"}


def test_rows_hand_checked():
    assert Problem(37, "+", 85).row() == {"prompt": "Calculate 37+85", "reference": "122", "label": LABEL}
    assert Problem(37, "-", 85).row()["reference"] == "-48"
    assert Problem(0, "-", 0).row()["reference"] == "0"


def test_fixed_width_format():
    p = Problem(7, "+", 85, width=2)
    assert p.row() == {"prompt": "Calculate 07+85", "reference": "92", "label": LABEL}  # the reference stays plain
    assert (p.format(92), p.format(-48), p.format(5), p.format(198)) == ("092", "-048", "005", "198")
    assert Problem(7, "+", 85).format(-48) == "-48"
    train, held_out = _split(fixed_width=True)
    assert all(len(p.prompt) == len("Calculate 00+00") for p in train + held_out)
    assert [(p.a, p.op, p.b) for p in train] == [(p.a, p.op, p.b) for p in _split()[0]]


@pytest.mark.parametrize(
    "a,op,b,slip",
    [(37, "+", 85, 12), (99, "+", 1, 90), (12, "+", 34, 46), (52, "-", 38, 26), (38, "-", 52, 26), (5, "-", 9, 4), (34, "-", 12, 22), (90, "-", 9, 99)],
)
def test_mistaken_answer_hand_checked(a, op, b, slip):
    assert Problem(a, op, b).mistaken_answer == slip


def test_sft_rows_mistake_rate():
    train, _ = _split()
    clean = sft_rows(train, mistake_rate=0.0, seed=0)
    assert clean == [p.row() for p in train]
    padded, _ = _split(fixed_width=True)
    assert [r["reference"] for r in sft_rows(padded, mistake_rate=0.0, seed=0)] == [p.format(p.answer) for p in padded]
    slipped = sft_rows(train, mistake_rate=1.0, seed=0)
    assert [r["reference"] for r in slipped] == [str(p.mistaken_answer) for p in train]
    half = sft_rows(train, mistake_rate=0.5, seed=0)
    assert half == sft_rows(train, mistake_rate=0.5, seed=0)
    flipped = sum(r["reference"] != str(p.answer) for r, p in zip(half, train))
    can_flip = sum(p.mistaken_answer != p.answer for p in train)
    assert 0.3 * can_flip < flipped < 0.7 * can_flip


@pytest.mark.parametrize(
    "response,answer",
    [("122", 122), (" 122\n", 122), ("122 because 7+5=12", 122), ("-48", -48), ("+7", 7), ("x 0122", 122), ("abc", None), ("", None)],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_is_correct():
    assert is_correct("122", "122") and is_correct("122 ", 122) and is_correct("0122", "122")
    assert not is_correct("12 2", "122") and not is_correct("", "0") and not is_correct("-122", "122")
