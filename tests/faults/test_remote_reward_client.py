"""The remote reward client against a busy or hostile server, on loopback (issue 35 item 5):

- many clients (default settings) against one `tidal serve-reward` that takes 2 requests at once:
  every sample is scored (32 clients used to lose half their samples after four 503s: the fixed
  `Retry-After: 1` brought them back together, about 3 s of retries in all); the client waits for
  a busy server, with jitter, up to `retry_deadline_s`, and the server's `Retry-After` follows its
  queue;
- a client sends no more requests at once than the server advertises (`max_in_flight`);
- a huge reply (a server streaming without end) is read no further than the batch's bound.
"""

import asyncio
import threading
import time

import pytest
import torch
from aiohttp import web

from tidal.rewards import RewardConfig, RewardEngine, RewardError, RewardSample
from tidal.rewards.base import ComponentResult
from tidal.rewards.remote import max_reply_bytes
from tidal.rewards.server import BusyEstimate, ServerLimits, build_app
from tests.integration.test_reward_server import Served

pytestmark = pytest.mark.timeout(180)


def samples(n: int) -> list[RewardSample]:
    return [RewardSample(prompt="p", response=f"r{i}", prompt_ids=[1], response_ids=[2], index=i) for i in range(n)]


def engine(url: str, on_error: str = "drop", **kw) -> RewardEngine:
    spec = {"type": "remote", "url": url, **kw}
    return RewardEngine(RewardConfig(components={"rm": spec}, recipes={"default": [["rm", 1.0]]}, on_error=on_error),
                        device=torch.device("cpu"))


def busy_server(max_in_flight: int, seconds: float, seen: dict):
    async def scorer(batch):
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        await asyncio.sleep(seconds)
        seen["now"] -= 1
        return ComponentResult(scores=[1.0] * len(batch))

    return build_app(scorer, info={"kind": "function", "target": "busy"}, limits=ServerLimits(max_in_flight=max_in_flight))


def test_many_default_clients_against_one_busy_server_lose_nothing():
    seen = {"now": 0, "most": 0}
    server = Served(busy_server(max_in_flight=2, seconds=0.05, seen=seen))
    results, clients = [None] * 16, 16
    try:
        def client(i: int) -> None:
            with engine(server.url) as eng:  # the defaults: batch_size 32, concurrency 4, max_retries 3
                results[i] = eng.score(samples(64))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        took = time.monotonic() - t0
    finally:
        server.close()
    lost = sum(int((~r.valid_B).sum()) for r in results)
    assert lost == 0, f"{lost} of {clients * 64} samples lost"
    assert all(r.metrics["reward/rm/failed_requests_count"] == 0.0 for r in results)
    assert seen["most"] <= 2 and took < 120


def test_a_client_sends_no_more_at_once_than_the_server_advertises():
    seen = {"now": 0, "most": 0}
    server = Served(busy_server(max_in_flight=2, seconds=0.2, seen=seen))
    try:
        with engine(server.url, batch_size=1, concurrency=8) as eng:
            out = eng.score(samples(8))
        replies = eng_replies(server.url)
    finally:
        server.close()
    assert out.valid_B.all() and seen["most"] == 2
    assert replies.get("503", 0) == 0  # it never asked for more than the server takes


def eng_replies(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/v1/info", timeout=5) as r:
        return json.loads(r.read())["replies"]


def test_retry_after_follows_the_queue():
    busy = BusyEstimate(max_in_flight=4)
    for _ in range(50):
        busy.finished(3.0)  # requests take 3 s
    first = busy.turn_away()
    for _ in range(14):
        last = busy.turn_away()
    assert first == 4  # ceil(3 x (1 + 1/4))
    assert last == 15  # 15 turned away within 6 s, 4 at a time: ceil(3 x (1 + 15/4))
    quick = BusyEstimate(max_in_flight=16)
    for _ in range(50):
        quick.finished(0.01)
    assert quick.turn_away() == 1  # whole seconds, at least 1


def test_a_huge_reply_is_read_no_further_than_its_bound():
    sent = {"bytes": 0}

    async def handler(request):
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b'{"api_version": 1, "scores": [' + b"1.0, " * 100_000
        try:
            for _ in range(2_000):  # up to ~1 GiB
                await resp.write(chunk)
                sent["bytes"] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    app = web.Application()
    app.router.add_post("/v1/score", handler)
    server = Served(app)
    try:
        with engine(server.url, on_error="raise", batch_size=4) as eng:
            t0 = time.monotonic()
            with pytest.raises(RewardError, match=rf"bad reply: reply longer than {max_reply_bytes(4)} bytes"):
                eng.score(samples(4))
            assert time.monotonic() - t0 < 30
    finally:
        server.close()
    assert sent["bytes"] < 64 * 2**20  # the client hung up long before a gibibyte
