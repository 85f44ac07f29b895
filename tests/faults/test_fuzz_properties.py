"""Property-based fuzzing (Hypothesis) of what users and services hand to Tidal: config overrides,
dataset rows, reward function outputs, reward-service replies and request bodies. Every input either
works or fails with an error that names its source (a ConfigError naming the key, a ValueError
naming file and line, a RewardError naming component and sample, HTTP 400/413 with the reason) --
never another exception from inside. Examples are bounded and derandomized, without deadlines."""

import asyncio
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.faults import rewards
from tests.faults.test_config_fuzz import KEYS, names_key
from tidal.config import load_config
from tidal.config_base import ConfigError

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# JSON-like values, with the numbers that break machine types: inf/nan, huge and tiny, bools as ints.
numbers = st.one_of(st.integers(), st.integers(min_value=2**62, max_value=2**80), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1e39, -1e39, 1e308, 5e-324, True, False]))
scalars = st.one_of(st.none(), numbers, st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


# ---- config overrides --------------------------------------------------------------------------------
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(json_values.map(lambda v: json.dumps(v)), st.text(max_size=30))),
                min_size=1, max_size=3))
def test_config_overrides_work_or_name_their_key(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    keys = [k for k, _ in pairs]
    try:
        cfg = load_config("quickstart", overrides)
        for world in (1, 2, 4):
            cfg.check_world(world)
    except ConfigError as e:
        assert any(names_key(e, k) for k in keys), (overrides, e)


# ---- dataset rows -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from tidal.tasks.tokenizer import train_tokenizer

    return train_tokenizer(["1+1=2", "hello world", "<|user|> <|assistant|>"], vocab_size=300)


row_values = st.one_of(json_values, st.fixed_dictionaries({"prompt": json_values}),
                       st.fixed_dictionaries({"messages": json_values}),
                       st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"role": st.text(max_size=8), "content": json_values}), max_size=3)}),
                       st.fixed_dictionaries({"prompt": st.text(max_size=40)}, optional={"label": json_values, "reference": json_values, "images": json_values}))
lines = st.one_of(row_values.map(lambda r: json.dumps(r).encode()), st.binary(max_size=40))


@FUZZ
@given(st.lists(lines, min_size=1, max_size=6))
def test_dataset_rows_load_or_name_file_and_line(tmp_path_factory, tokenizer, raw_lines):
    from tidal.data import PromptDataset
    from tidal.data.config import DataConfig, DataSource

    path = tmp_path_factory.mktemp("rows") / "train.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in raw_lines) + b"\n")
    try:
        ds = PromptDataset([DataSource(path=str(path))], tokenizer, DataConfig(max_prompt_len=4096), seed=1)
        for i in range(len(ds)):
            ds[i]
    except ValueError as e:
        assert f"{path}:" in str(e) or (str(path) in str(e) and "no" in str(e)), e  # file:line, or the file when it has no rows


# ---- reward outputs ---------------------------------------------------------------------------------
EDGES = [1e39, -1e39, math.inf, math.nan, 2**1100, 3.4e38, "1.0", None, [1.0], True]
outputs = st.one_of(st.sampled_from(EDGES), json_values, st.floats(width=32), st.builds(torch.tensor, st.floats(allow_nan=True)),
                    st.builds(lambda n: torch.zeros(n), st.integers(0, 3)))


def _engine(path: str, on_error: str):
    from tidal.rewards import RewardConfig, RewardEngine

    cfg = RewardConfig(components={"f": {"type": "function", "path": path, "timeout_s": 5}}, recipes={"default": [["f", 1.0]]}, on_error=on_error)
    return RewardEngine(cfg, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def reward_engines():
    engines = {(fn, mode): _engine(f"tests.faults.rewards:{fn}", mode) for fn in ("fuzz_value", "fuzz_batched") for mode in ("raise", "drop")}
    yield engines
    for e in engines.values():
        e.close()


@FUZZ
@given(st.lists(outputs, min_size=1, max_size=4), st.sampled_from(["fuzz_value", "fuzz_batched"]), st.sampled_from(["raise", "drop"]))
def test_reward_outputs_score_or_name_component_and_sample(reward_engines, values, fn, on_error):
    from tidal.rewards import RewardError, RewardSample

    rewards.FUZZ_VALUES[:] = values
    samples = [RewardSample(prompt="p", response="r", prompt_ids=[1], response_ids=[2], index=i) for i in range(len(values))]
    try:
        out = reward_engines[(fn, on_error)].score(samples)
    except RewardError as e:
        assert on_error == "raise" and ("reward component 'f' failed on sample " in str(e) or "reward total failed on sample " in str(e)), e
        return
    assert torch.isfinite(out.total_B).all() and out.total_B.dtype == torch.float32
    assert math.isfinite(out.metrics["reward/total"]) or not out.valid_B.any()


# ---- reward-service replies and request bodies --------------------------------------------------------
@FUZZ
@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=60),
                 st.fixed_dictionaries({"api_version": st.just(1), "scores": json_values}, optional={"errors": json_values}).map(lambda v: json.dumps(v).encode())),
       st.integers(1, 3))
def test_service_replies_decode_or_raise_a_protocol_error(body, n):
    from tidal.rewards import protocol

    try:
        scores, errors = protocol.decode_response(body, n)
    except protocol.ProtocolError:
        return
    assert len(scores) == n and all(math.isfinite(s) and abs(s) <= 3.4028234663852886e38 or i in errors for i, s in enumerate(scores))


sample_objects = st.one_of(json_values, st.fixed_dictionaries({"prompt": json_values, "response": json_values},
                                                               optional={"prompt_ids": json_values, "response_ids": json_values, "label": json_values,
                                                                         "metadata": json_values, "finish_reason": json_values, "reference": json_values}))
request_bodies = st.one_of(st.binary(max_size=80), json_values.map(lambda v: json.dumps(v).encode()),
                           st.lists(sample_objects, max_size=3).map(lambda s: json.dumps({"samples": s}).encode()))


@FUZZ
@given(request_bodies)
def test_request_bodies_decode_or_raise_a_protocol_error(body):
    from tidal.rewards import protocol

    try:
        samples = protocol.decode_request(body)
    except protocol.ProtocolError:
        return
    assert all(isinstance(s.prompt, str) and isinstance(s.response, str) for s in samples)


@pytest.fixture(scope="module")
def server_client():
    from aiohttp.test_utils import TestClient, TestServer

    from tidal.rewards.function import FunctionReward
    from tidal.rewards.config import FunctionRewardConfig
    from tidal.rewards.server import ServerLimits, build_app

    comp = FunctionReward(FunctionRewardConfig(path="tests.faults.rewards:text_hash_reward"), key="f")
    app = build_app(comp.score_async, info={"kind": "function", "target": "t"}, limits=ServerLimits(max_batch_size=2, max_sample_kb=1))
    loop = asyncio.new_event_loop()
    client = TestClient(TestServer(app), loop=loop)
    loop.run_until_complete(client.start_server())
    yield loop, client
    loop.run_until_complete(client.close())
    loop.close()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(request_bodies)
def test_server_answers_every_body_with_200_400_or_413(server_client, body):
    loop, client = server_client

    async def post():
        resp = await client.post("/v1/score", data=body, headers={"Content-Type": "application/json"})
        return resp.status, await resp.json()

    status, reply = loop.run_until_complete(post())
    assert status in (200, 400, 413), (body[:80], status, reply)
    assert (status == 200 and len(reply["scores"]) == len(json.loads(body)["samples"])) or reply["error"]
