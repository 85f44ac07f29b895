"""Rewards scored while decoding (RewardStream): groups submitted as they end, in any order, give
exactly what one RewardEngine.score call over the batch gives at the end: the same rewards in the
same order, the same errors (with the batch's sample numbers), drops and counts."""

import math
import threading

import pytest
import torch

from tidal.envs.trajectory import TrajectoryBuilder
from tidal.envs.base import EnvRow
from tidal.rewards import RewardConfig, RewardEngine, RewardError, RewardSample
from tidal.rewards.stream import RewardStream
from tidal.trainer.experience_maker import GroupScoring

HERE = __name__
SCORED: list[str] = []  # responses the per-sample function saw, in call order
_lock = threading.Lock()


def resp_len(sample):
    with _lock:
        SCORED.append(sample.response)
    return len(sample.response)


def raises_on_boom(sample):
    if sample.response == "boom":
        raise ValueError("exploded")
    return 1


def batched_count(samples):
    batched_count.sizes.append(len(samples))
    return [float(len(samples))] * len(samples)


batched_count.batched = True
batched_count.sizes = []


def S(response, i, reference="4", label=""):
    return RewardSample(prompt="Q", response=response, prompt_ids=[1], response_ids=[2, 3], reference=reference,
                        label=label, index=i)


def _engine(on_error="raise", batched=False):
    components = {"len": {"type": "function", "path": f"{HERE}:resp_len"}, "math": {"type": "math_answer"},
                  "boom": {"type": "function", "path": f"{HERE}:raises_on_boom"},
                  "fmt": {"type": "think_answer_format"}}  # a rule scored in the background
    recipes = {"default": [["len", 0.5], ["math", 1.0], ["boom", 1.0], ["fmt", 0.25]], "short": [["math", 2.0]]}
    if batched:
        components["count"] = {"type": "function", "path": f"{HERE}:batched_count"}
        recipes["default"].append(["count", 1.0])
    return RewardEngine(RewardConfig(components=components, recipes=recipes, on_error=on_error), device=torch.device("cpu"))


BATCH = ["\\boxed{4}", "ab", "boom", "\\boxed{5}", "abcdef", "\\boxed{4} x", "boom", "<think>a</think><answer>4</answer>"]


def _samples():
    return [S(r, i, label="short" if i == 5 else "") for i, r in enumerate(BATCH)]


def _same(got, want):
    assert torch.equal(got.total_B, want.total_B) and torch.equal(got.valid_B, want.valid_B)
    assert got.components.keys() == want.components.keys()
    for k in want.components:
        assert torch.equal(got.components[k], want.components[k])
        assert torch.equal(got.component_masks[k], want.component_masks[k])
    keys = {k for k in want.metrics if not k.endswith("/seconds")}
    assert {k for k in got.metrics if not k.endswith("/seconds")} == keys
    for k in keys:
        a, b = got.metrics[k], want.metrics[k]
        assert (math.isnan(a) and math.isnan(b)) or a == b, k


@pytest.mark.parametrize("batched", [False, True], ids=["per-sample", "with-a-batched-function"])
def test_groups_scored_in_any_order_equal_scoring_at_the_end(batched):
    samples = _samples()
    with _engine("drop", batched) as eng:
        batched_count.sizes = []
        want = eng.score(samples)
        assert batched_count.sizes == ([7] if batched else [])  # sample 5's recipe lacks it
        # math_answer's time limit works on the main thread only: it scores at the end
        assert eng.streams("len") and eng.streams("boom") and not eng.streams("math")
        assert not batched or not eng.streams("count")
        stream = RewardStream(eng)
        SCORED.clear()
        for group in ([4, 5], [0, 1], [6, 7], [2, 3]):  # groups end in any order
            stream.submit(group, [samples[i] for i in group])
        got = stream.results(samples)
        assert sorted(SCORED) == sorted(r for i, r in enumerate(BATCH) if i != 5)  # each scored once, ahead
    _same(got, want)
    assert got.valid_B.tolist() == [True, True, False, True, True, True, False, True]
    if batched:  # a batched function still sees the whole batch, once, at the end
        assert batched_count.sizes == [7, 7]


def test_a_piece_with_a_changed_sample_and_one_never_submitted_are_scored_at_the_end():
    samples = _samples()
    with _engine("drop") as eng:
        want = eng.score(samples)
        stream = RewardStream(eng)
        stream.submit([0, 1], [S(BATCH[0], 0), S(BATCH[1], 7)])  # the second with another index
        stream.submit([2, 3], samples[2:4])
        stream._pool.submit(lambda: None).result()  # both pieces are scored by now
        SCORED.clear()
        got = stream.results(samples)  # 4..7 never submitted
        assert sorted(SCORED) == sorted([BATCH[0], BATCH[1], BATCH[4], BATCH[6], BATCH[7]])  # the piece [0, 1] again
    _same(got, want)


def test_errors_raise_like_scoring_at_the_end():
    samples = _samples()
    with _engine("raise") as eng:
        with pytest.raises(RewardError) as at_end:
            eng.score(samples)
        stream = RewardStream(eng)
        stream.submit([6, 7], samples[6:])
        stream.submit([0, 1, 2, 3, 4, 5], samples[:6])
        with pytest.raises(RewardError) as streamed:
            stream.results(samples)
    assert str(streamed.value) == str(at_end.value)
    assert "sample 2" in str(at_end.value) and "(1 more samples failed)" in str(at_end.value)


def _trajectory(prompt_ids, text, group_id):
    b = TrajectoryBuilder(prompt_ids)
    b.add_turn([7, 8], [-0.1, -0.2], "stop", text)
    row = EnvRow(prompt_ids=prompt_ids, prompt_text="Q", reference="4")
    return b.finish(row=row, group_id=group_id, finish_reason="done")


def test_group_scoring_submits_each_group_when_its_last_member_ends():
    texts = ["\\boxed{4}", "ab", "\\boxed{3}", "abcd"]
    trajs = [_trajectory([1, 2], t, i // 2) for i, t in enumerate(texts)]
    samples = [t.reward_sample(i) for i, t in enumerate(trajs)]
    with _engine("drop") as eng:
        want = eng.score(samples)
        stream = RewardStream(eng)
        feed = GroupScoring(stream, n=2)
        SCORED.clear()
        for i in (3, 0, 2):  # group 1 ends first; group 0 waits for its last member
            feed(i, trajs[i])
        stream._pool.submit(lambda: None).result()  # the submitted group is scored by now
        assert sorted(SCORED) == sorted(texts[2:])
        feed(1, trajs[1])
        got = stream.results(samples)
    _same(got, want)
