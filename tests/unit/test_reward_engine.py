"""RewardEngine: recipes, weighted totals, custom functions (sync/async/batched), errors and drops."""

import asyncio
import math
import threading
import time

import pytest
import torch

from tidal.config_base import ConfigError
from tidal.rewards import RewardConfig, RewardEngine, RewardError, RewardSample

HERE = __name__


def S(response, reference=None, label="", n_tokens=4):
    return RewardSample(prompt="Q: 2+2?", response=response, prompt_ids=[5, 6], response_ids=list(range(n_tokens)), reference=reference, label=label)


# ---- functions the tests name by path ----------------------------------------------------------
def resp_len(sample):
    return len(sample.response)


async def async_half(sample):
    await asyncio.sleep(0.001)
    return 0.5


def raises_on_boom(sample):
    if sample.response == "boom":
        raise ValueError("exploded")
    return 1


_release = threading.Event()


def hangs(sample):
    if sample.response == "hang":
        _release.wait(10)  # bounded even if the test fails
    return 1.0


async def async_hangs(sample):
    if sample.response == "hang":
        await asyncio.sleep(10)
    return 1.0


def returns_nan(sample):
    return math.nan if sample.response == "nan" else 1.0


def returns_text(sample):
    return "1.0"


def returns_tensor(sample):
    return torch.tensor(3.0)


def sees_only_response(sample):
    assert "Q:" not in sample.response
    return 1.0 if sample.prompt == "Q: 2+2?" else 0.0


def batched_lengths(samples):
    batched_lengths.calls += 1
    return [len(s.response) for s in samples]


batched_lengths.batched = True
batched_lengths.calls = 0


def batched_short(samples):
    return [1.0] * (len(samples) - 1)


batched_short.batched = True


# ---- helpers -------------------------------------------------------------------------------------
def engine(components, recipes=None, **kw):
    recipes = recipes or {"default": [[name, 1.0] for name in components]}
    return RewardEngine(RewardConfig(components=components, recipes=recipes, **kw), device=torch.device("cpu"))


def fn(name, **kw):
    return {"type": "function", "path": f"{HERE}:{name}", **kw}


def test_recipe_with_two_components_hand_computed():
    eng = engine(
        {"len": fn("resp_len"), "fmt": {"type": "think_answer_format"}},
        {"default": [["len", 1.0], ["fmt", 0.5]]},
    )
    out = eng.score([S("<think>a</think><answer>4</answer>"), S("4")])
    # len: 16 + 18 = 34 and 1; fmt: 1 and 0  ->  total = len + 0.5 * fmt
    assert out.components["len"].tolist() == [34.0, 1.0]
    assert out.components["fmt"].tolist() == [1.0, 0.0]
    assert out.total_B.tolist() == [34.5, 1.0]
    assert out.total_B.dtype == torch.float32 and out.valid_B.tolist() == [True, True]
    assert out.metrics["reward/len"] == pytest.approx(17.5)
    assert out.metrics["reward/fmt"] == pytest.approx(0.5)
    assert out.metrics["reward/total"] == pytest.approx(17.75)
    assert out.metrics["reward/dropped_count"] == 0.0 and out.metrics["reward/len/errors_count"] == 0.0
    eng.close()


def test_labels_pick_recipes_and_only_needed_components_run():
    batched_lengths.calls = 0
    eng = engine(
        {"math": {"type": "math_answer"}, "len": fn("batched_lengths"), "short": {"type": "length_penalty", "max_tokens": 8}},
        {"default": [["math", 1.0]], "chat": [["len", 0.1], ["short", 2.0]]},
    )
    out = eng.score([S("\\boxed{4}", "#### 4"), S("hello", label="chat", n_tokens=4), S("\\boxed{5}", "4")])
    assert out.components["math"].tolist() == [1.0, 0.0, 0.0]
    assert out.component_masks["math"].tolist() == [True, False, True]
    assert out.components["len"].tolist() == [0.0, 5.0, 0.0]
    assert out.component_masks["len"].tolist() == [False, True, False]
    assert out.components["short"].tolist() == [0.0, -0.5, 0.0]
    assert out.total_B.tolist() == pytest.approx([1.0, 0.1 * 5 + 2.0 * -0.5, 0.0])
    assert out.metrics["reward/math"] == 0.5 and out.metrics["reward/math/count"] == 2.0
    assert out.metrics["reward/len/count"] == 1.0
    assert batched_lengths.calls == 1
    # a batch without the chat label never calls its function, and reports it consistently
    out = eng.score([S("\\boxed{4}", "4")])
    assert batched_lengths.calls == 1
    assert math.isnan(out.metrics["reward/len"]) and out.metrics["reward/len/count"] == 0.0
    eng.close()


def test_unknown_label_and_missing_default_are_errors():
    eng = engine({"m": {"type": "math_answer"}}, {"default": [["m", 1.0]]})
    with pytest.raises(RewardError, match="sample 1 has label 'geo'"):
        eng.score([S("x"), S("x", label="geo")])
    eng = engine({"m": {"type": "math_answer"}}, {"math": [["m", 1.0]], "chat": [["m", 2.0]]}, default_recipe=None)
    with pytest.raises(RewardError, match="sample 0 has no label.*set reward.default_recipe"):
        eng.score([S("x")])
    assert eng.score([S("\\boxed{1}", "1", label="math")]).total_B.tolist() == [1.0]
    eng = engine({"m": {"type": "math_answer"}}, {"math": [["m", 1.0]]})  # one recipe: unlabelled rows use it
    assert eng.score([S("\\boxed{1}", "1")]).total_B.tolist() == [1.0]


def test_empty_config_and_empty_batch():
    out = RewardEngine(RewardConfig(), device=torch.device("cpu")).score([S("x"), S("y")])  # distillation alone
    assert out.total_B.tolist() == [0.0, 0.0] and out.valid_B.all() and out.components == {}
    out = engine({"m": {"type": "math_answer"}}).score([])
    assert out.total_B.shape == (0,) and out.valid_B.shape == (0,)


def test_sync_async_tensor_functions():
    with engine({"a": fn("async_half"), "t": fn("returns_tensor"), "p": fn("sees_only_response")}) as eng:
        out = eng.score([S("4"), S("5")])
    assert out.components["a"].tolist() == [0.5, 0.5]
    assert out.components["t"].tolist() == [3.0, 3.0]
    assert out.components["p"].tolist() == [1.0, 1.0]
    assert out.total_B.tolist() == [4.5, 4.5]


def test_function_path_forms_and_import_errors():
    with engine({"f": {"type": "function", "path": f"{HERE}.resp_len"}}) as eng:
        assert eng.score([S("abc")]).total_B.tolist() == [3.0]
    with pytest.raises(ConfigError) as e:
        engine({"f": {"type": "function", "path": "no_such_module_xyz:f"}})
    assert e.value.key == "reward.components.f.path"
    with pytest.raises(ConfigError, match="has no attribute"):
        engine({"f": {"type": "function", "path": f"{HERE}:nope"}})
    with pytest.raises(ConfigError, match="not 'module:function'"):
        engine({"f": {"type": "function", "path": "justaname"}})


def test_raising_function_names_sample_and_function():
    with engine({"f": fn("raises_on_boom")}) as eng:
        with pytest.raises(RewardError) as e:
            eng.score([S("ok"), S("ok"), S("boom")])
    msg = str(e.value)
    assert "component 'f'" in msg and "sample 2" in msg and f"{HERE}:raises_on_boom" in msg and "ValueError: exploded" in msg


def test_drop_policy_marks_invalid_and_counts():
    with engine({"f": fn("raises_on_boom"), "g": fn("resp_len")}, on_error="drop") as eng:
        out = eng.score([S("ok"), S("boom"), S("okay")])
    assert out.valid_B.tolist() == [True, False, True]
    assert out.total_B.tolist() == [3.0, 0.0, 5.0]  # dropped sample: total 0, excluded by valid_B
    assert out.component_masks["f"].tolist() == [True, False, True]
    assert out.metrics["reward/dropped_count"] == 1.0 and out.metrics["reward/total/count"] == 2.0
    assert out.metrics["reward/f/errors_count"] == 1.0 and out.metrics["reward/g/errors_count"] == 0.0
    assert out.metrics["reward/total"] == pytest.approx(4.0)
    assert out.metrics["reward/g"] == pytest.approx(3.0)  # means are over valid samples only


@pytest.mark.parametrize("name, match", [("returns_nan", "returned nan"), ("returns_text", "returned str")])
def test_bad_values_are_errors(name, match):
    with engine({"f": fn(name)}) as eng:
        with pytest.raises(RewardError, match=match):
            eng.score([S("ok"), S("nan")])


@pytest.mark.parametrize("name", ["hangs", "async_hangs"])
def test_per_sample_timeout(name):
    _release.clear()
    with engine({"f": fn(name, timeout_s=0.3)}, on_error="drop") as eng:
        t0 = time.perf_counter()
        out = eng.score([S("a"), S("hang"), S("b")])
        elapsed = time.perf_counter() - t0
    _release.set()
    assert elapsed < 3.0
    assert out.valid_B.tolist() == [True, False, True]
    assert out.metrics["reward/f/timeouts_count"] == 1.0
    _release.clear()
    with engine({"f": fn(name, timeout_s=0.2)}) as eng:
        with pytest.raises(RewardError, match="sample 0: timed out after 0.2 s"):
            eng.score([S("hang")])
    _release.set()


def test_batched_function_wrong_length():
    with engine({"f": fn("batched_short")}) as eng:
        with pytest.raises(RewardError, match="returned 1 values for 2 samples"):
            eng.score([S("a"), S("b")])
    with engine({"f": fn("batched_short")}, on_error="drop") as eng:
        out = eng.score([S("a"), S("b")])
    assert out.valid_B.tolist() == [False, False] and out.metrics["reward/dropped_count"] == 2.0
    assert math.isnan(out.metrics["reward/total"])


def test_concurrency_limit_overlaps_sync_calls():
    # 8 calls of 0.2 s with concurrency 8 take about 0.2 s, not 1.6 s
    with engine({"f": fn("sleepy", concurrency=8)}) as eng:
        t0 = time.perf_counter()
        out = eng.score([S(str(i)) for i in range(8)])
        assert time.perf_counter() - t0 < 1.0
    assert out.total_B.tolist() == [1.0] * 8


def sleepy(sample):
    time.sleep(0.2)
    return 1.0
