"""Remote rewards: the HTTP client against tidal's server and against misbehaving servers, on loopback."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from aiohttp import web

from tidal.config_base import ConfigError
from tidal.rewards import RewardConfig, RewardEngine, RewardError, RewardSample
from tidal.rewards.function import FunctionReward
from tidal.rewards.config import FunctionRewardConfig
from tidal.rewards.server import ServerLimits, build_app, serve

HERE = __name__


def length_reward(sample):
    if sample.response == "boom":
        raise ValueError("exploded")
    return float(len(sample.response))


class Served:
    """Runs an aiohttp app on 127.0.0.1:<free port> in a background loop (bounded start/stop)."""

    def __init__(self, app):
        self.loop = asyncio.new_event_loop()
        self.port = None
        started = threading.Event()

        def ready(port):
            self.port = port
            started.set()

        async def main():
            self.stop = asyncio.Event()
            await serve(app, "127.0.0.1", 0, ready=ready, stop=self.stop)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(10), "server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


@pytest.fixture
def serve_app():
    servers = []

    def start(app):
        servers.append(Served(app))
        return servers[-1].url

    yield start
    for s in servers:
        s.close()


def function_app(token=None, max_batch_size=64):
    comp = FunctionReward(FunctionRewardConfig(path=f"{HERE}:length_reward", timeout_s=5), key="t")
    limits = ServerLimits(max_batch_size=max_batch_size)
    return build_app(comp.score_async, info={"kind": "function", "target": "length_reward"}, token=token, limits=limits)


def samples(*responses):
    return [RewardSample(prompt="p", response=r, prompt_ids=[1], response_ids=[2, 3], reference={"a": [1]}, metadata={"k": "v"}) for r in responses]


def remote_engine(url, on_error="raise", **kw):
    spec = {"type": "remote", "url": url, "timeout_s": 2.0, "backoff_s": 0.01, "max_backoff_s": 0.05, **kw}
    return RewardEngine(RewardConfig(components={"rm": spec}, recipes={"default": [["rm", 1.0]]}, on_error=on_error), device=torch.device("cpu"))


def test_function_server_with_batching(serve_app):
    url = serve_app(function_app())
    with remote_engine(url, batch_size=2, concurrency=2) as eng:
        out = eng.score(samples("a", "bb", "ccc", "dddd", "eeeee"))
    assert out.total_B.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert out.metrics["reward/rm/retries_count"] == 0.0 and out.metrics["reward/rm/failed_requests_count"] == 0.0


def test_per_sample_server_error_is_not_a_zero(serve_app):
    url = serve_app(function_app())
    with remote_engine(url) as eng:
        with pytest.raises(RewardError, match="sample 1: server: function .* raised ValueError: exploded"):
            eng.score(samples("a", "boom"))
    with remote_engine(url, on_error="drop") as eng:
        out = eng.score(samples("a", "boom"))
    assert out.valid_B.tolist() == [True, False] and out.metrics["reward/dropped_count"] == 1.0


def test_bearer_token(serve_app, monkeypatch):
    url = serve_app(function_app(token="s3cret"))
    with remote_engine(url, on_error="drop") as eng:  # a missing token raises even under drop
        with pytest.raises(RewardError, match="HTTP 401"):
            eng.score(samples("a"))
    monkeypatch.setenv("TIDAL_TEST_TOKEN", "wrong")
    with remote_engine(url, token_env="TIDAL_TEST_TOKEN") as eng:
        with pytest.raises(RewardError, match="HTTP 401"):
            eng.score(samples("a"))
    monkeypatch.setenv("TIDAL_TEST_TOKEN", "s3cret")
    with remote_engine(url, token_env="TIDAL_TEST_TOKEN") as eng:
        assert eng.score(samples("abc")).total_B.tolist() == [3.0]
    monkeypatch.delenv("TIDAL_TEST_TOKEN")
    with pytest.raises(ConfigError) as e:
        remote_engine(url, token_env="TIDAL_TEST_TOKEN")
    assert e.value.key == "reward.components.rm.token_env"


def test_server_rejects_bad_requests(serve_app):
    import urllib.request
    from urllib.error import HTTPError

    url = serve_app(function_app(max_batch_size=2))

    def post(body):
        req = urllib.request.Request(url + "/v1/score", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, json.loads(r.read())
        except HTTPError as e:
            return e.code, json.loads(e.read())

    assert post(b"{not json")[0] == 400
    assert post(b'{"samples": [{"prompt": "p"}]}') == (400, {"error": "samples[0] lacks 'response'"})
    assert post(b'{"samples": [{"prompt": "p", "response": "r", "extra": 1}]}')[0] == 400
    assert post(json.dumps({"samples": [{"prompt": "p", "response": "r"}] * 3}).encode())[0] == 413
    status, body = post(b'{"samples": [{"prompt": "p", "response": "rr"}, {"prompt": "p", "response": "boom"}]}')
    assert status == 200 and body["api_version"] == 1 and body["scores"] == [2.0, None]
    assert body["errors"][0] is None and "exploded" in body["errors"][1]
    with urllib.request.urlopen(url + "/v1/info", timeout=5) as r:
        assert json.loads(r.read()) == {"api_version": 1, "max_batch_size": 2, "max_body_bytes": 2 * 256 * 1024 + 64 * 1024, "max_in_flight": 16,
                                        "kind": "function", "target": "length_reward", "replies": {"200": 1, "400": 3, "413": 1}}


def misbehaving_app(handler):
    app = web.Application()
    app.router.add_post("/v1/score", handler)
    return app


def test_500_then_success_is_retried(serve_app):
    calls = []

    async def handler(request):
        calls.append(1)
        n = len((await request.json())["samples"])
        if len(calls) < 3:
            return web.Response(status=500 if len(calls) == 1 else 429, text="busy", headers={"Retry-After": "0"})
        return web.json_response({"api_version": 1, "scores": [0.25] * n})

    with remote_engine(serve_app(misbehaving_app(handler)), max_retries=3) as eng:
        out = eng.score(samples("a", "b"))
    assert out.total_B.tolist() == [0.25, 0.25] and len(calls) == 3
    assert out.metrics["reward/rm/retries_count"] == 1.0  # the 500; a busy 429 is waited for, not a retry


def test_persistent_500_fails_after_bounded_retries(serve_app):
    calls = []

    async def handler(request):
        calls.append(1)
        return web.Response(status=500, text="kaput")

    url = serve_app(misbehaving_app(handler))
    with remote_engine(url, max_retries=2) as eng:
        with pytest.raises(RewardError, match="failed after 3 attempts; last: HTTP 500: kaput"):
            eng.score(samples("a"))
    assert len(calls) == 3
    with remote_engine(url, max_retries=1, on_error="drop") as eng:
        out = eng.score(samples("a", "b"))
    assert out.valid_B.tolist() == [False, False] and out.total_B.tolist() == [0.0, 0.0]
    assert out.metrics["reward/dropped_count"] == 2.0 and out.metrics["reward/rm/failed_requests_count"] == 1.0


def test_timeout_is_retried_then_an_error(serve_app):
    calls = []

    async def handler(request):
        calls.append(1)
        await asyncio.sleep(0.7)
        return web.json_response({"api_version": 1, "scores": [1.0]})

    with remote_engine(serve_app(misbehaving_app(handler)), timeout_s=0.2, max_retries=1) as eng:
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match="timed out after 0.2 s"):
            eng.score(samples("a"))
        assert time.perf_counter() - t0 < 1.5
    assert len(calls) == 2


@pytest.mark.parametrize(
    "reply, match",
    [
        (b"{oops", "malformed JSON"),
        (b'{"api_version": 1, "scores": [1.0]}', "1 scores for 2 samples"),
        (b'{"api_version": 1, "scores": [1.0, 2.0, 3.0]}', "3 scores for 2 samples"),
        (b'{"api_version": 1, "scores": [1.0, "2"]}', "scores\\[1\\] is '2', not a number"),
        (b'{"api_version": 1, "scores": [1.0, NaN]}', "non-finite number NaN"),
        (b'{"api_version": 2, "scores": [1.0, 2.0]}', "api_version is 2"),
        (b'{"api_version": 1, "scores": [1.0, null]}', "server returned null without an error"),
    ],
)
def test_bad_replies_are_errors_not_zeros(serve_app, reply, match):
    calls = []

    async def handler(request):
        calls.append(1)
        return web.Response(body=reply, content_type="application/json")

    with remote_engine(serve_app(misbehaving_app(handler))) as eng:
        with pytest.raises(RewardError, match=match):
            eng.score(samples("a", "b"))
    assert len(calls) == 1  # a protocol violation is not retried


def test_connection_refused_is_retried_then_an_error():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with remote_engine(f"http://127.0.0.1:{port}", max_retries=1) as eng:
        with pytest.raises(RewardError, match="failed after 2 attempts"):
            eng.score(samples("a"))


def test_serve_reward_main_subprocess(tmp_path):
    """`tidal serve-reward` as a process: --function, port 0, token from the environment."""
    (tmp_path / "my_rewards.py").write_text("def score(sample):\n    return sample.response.count('a')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}", "MY_TOKEN": "tok"}
    cmd = [sys.executable, "-c", "import sys; from tidal.rewards.server import main; sys.exit(main(sys.argv[1:]))",
           "--function", "my_rewards:score", "--port", "0", "--token-env", "MY_TOKEN"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # the server prints its address once listening
        assert "listening on http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.split("listening on ")[1].split()[0]
        os.environ["MY_TOKEN_CLIENT"] = "tok"
        with remote_engine(url, token_env="MY_TOKEN_CLIENT") as eng:
            assert eng.score(samples("banana", "b")).total_B.tolist() == [3.0, 0.0]
    finally:
        os.environ.pop("MY_TOKEN_CLIENT", None)
        proc.terminate()
        assert proc.wait(10) == 0


def test_model_server_scores_like_the_local_component(serve_app, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    from tidal.rewards.server import model_scorer, parse_args

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["one two three four five"], trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, num_labels=1, pad_token_id=0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    local_spec = {"type": "model", "path": str(tmp_path / "rm"), "tokenizer": str(tmp_path / "tok"), "separator": " "}
    batch = samples("two", "three four five", "one")
    with RewardEngine(RewardConfig(components={"rm": local_spec}, recipes={"default": [["rm", 1.0]]}), device=torch.device("cpu")) as eng:
        local = eng.score(batch).total_B.tolist()
    args = parse_args(["--model", str(tmp_path / "rm"), "--tokenizer", str(tmp_path / "tok"), "--device", "cpu",
                       "--separator", " ", "--micro-batch-size", "2"])
    url = serve_app(build_app(model_scorer(args), info={"kind": "model", "target": "rm"}))
    with remote_engine(url, batch_size=2) as eng:
        remote = eng.score(batch).total_B.tolist()
    assert remote == pytest.approx(local, abs=1e-5) and len(set(local)) == 3
