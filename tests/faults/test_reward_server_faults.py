"""``tidal serve-reward`` under abuse, as a real process on loopback: bodies past the limit (413
while reading), more requests than it takes at once (503 + Retry-After), slow and idle clients
(closed, 408), malformed bodies (400 with the reason), reward functions that exit, end their worker
or hang (that sample's error; the server goes on), and 1,000 concurrent clients (slow test: bounded
memory and threads, every request answered exactly once)."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
F = "tests.faults.rewards"
pytestmark = pytest.mark.timeout(120)


class Server:
    """``tidal serve-reward --function ...`` in its own process on 127.0.0.1 (port 0)."""

    def __init__(self, fn: str, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-c", "import sys; from tidal.rewards.server import main; sys.exit(main(sys.argv[1:]))",
               "--function", f"{F}:{fn}", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + self.proc.stderr.read()
        self.port = int(line.split("127.0.0.1:")[1].split()[0])
        self.url = f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def status(self) -> dict[str, int]:
        """VmRSS (KiB) and Threads of the server process."""
        fields = dict(line.split(":", 1) for line in open(f"/proc/{self.proc.pid}/status").read().splitlines() if ":" in line)
        return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"])}

    def close(self) -> None:
        self.proc.terminate()
        try:
            assert self.proc.wait(15) == 0
        finally:
            self.proc.kill()


@pytest.fixture
def server():
    started = []

    def start(fn: str = "text_hash_reward", *args: str) -> Server:
        started.append(Server(fn, *args))
        return started[-1]

    yield start
    for s in started:
        s.close()


def post(url: str, body: bytes, headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, dict]:
    import urllib.request
    from urllib.error import HTTPError

    req = urllib.request.Request(url + "/v1/score", data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def samples(*responses: str) -> bytes:
    return json.dumps({"samples": [{"prompt": "p", "response": r} for r in responses]}).encode()


def raw(port: int, data: bytes, *, wait_s: float) -> bytes:
    """Send ``data`` on a fresh connection; what the server says within ``wait_s`` (until it pauses
    for 0.3 s once it has begun answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                s.settimeout(0.3)
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_body_limit_from_the_api_limits_is_enforced_while_reading(server):
    srv = server("text_hash_reward", "--max-batch-size", "2", "--max-sample-kb", "1")
    limit = 2 * 1024 + 64 * 1024
    # a declared length past the limit: 413 at once, before a byte of the body is read
    t0 = time.monotonic()
    head = f"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {10**9}\r\n\r\n".encode()
    reply = raw(srv.port, head, wait_s=3)
    assert reply.startswith(b"HTTP/1.1 413") and f"at most {limit}".encode() in reply, reply[:300]
    assert time.monotonic() - t0 < 2.5
    # a chunked body (no length) is cut off once past the limit
    chunk = b"x" * 8192
    chunked = head.replace(f"Content-Length: {10**9}".encode(), b"Transfer-Encoding: chunked")
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20))  # 160 KiB
    assert raw(srv.port, chunked + body, wait_s=3).startswith(b"HTTP/1.1 413")
    # within the limit, but more samples than --max-batch-size
    assert post(srv.url, samples("a", "b", "c"))[0] == 413
    assert post(srv.url, samples("a", "b"))[0] == 200
    assert srv.alive()


def test_more_requests_than_it_takes_get_503_with_retry_after(server):
    import threading

    srv = server("hangs_forever", "--max-in-flight", "1", "--timeout-s", "3", "--concurrency", "1")
    slow = threading.Thread(target=post, args=(srv.url, samples("hang")))
    slow.start()
    time.sleep(1.0)  # the first request is being scored
    status, body, headers = post(srv.url, samples("a"))
    assert status == 503 and 1 <= int(headers["Retry-After"]) <= 60 and "--max-in-flight" in body["error"]
    slow.join(20)
    assert post(srv.url, samples("a"))[0] == 200  # free again


def test_slow_and_idle_clients_are_cut_off(server):
    srv = server("text_hash_reward", "--idle-timeout-s", "0.5", "--body-timeout-s", "0.5")
    # a head sent a byte at a time (slowloris): the connection is closed
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        t0, closed = time.monotonic(), False
        for byte in b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        if not closed:
            s.settimeout(3)
            try:
                closed = s.recv(1024) == b""
            except ConnectionResetError:
                closed = True
        assert closed and time.monotonic() - t0 < 4
    # a connection that sends nothing is closed too
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        t0 = time.monotonic()
        assert s.recv(1024) == b"" and time.monotonic() - t0 < 3
    # a body that never completes: 408
    head = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    reply = raw(srv.port, head + b'{"samples"', wait_s=4)
    assert reply.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in reply, reply[:300]
    assert post(srv.url, samples("a"))[0] == 200


MALFORMED = {
    b"": "malformed JSON",
    b"\xff\xfe{}": "not UTF-8",
    b"[" * 100_000 + b"]" * 100_000: "nested too deeply",
    b'{"samples": [{"prompt": "p", "response": "r", "prompt_ids": [1' + b"0" * 5000 + b"]}]}": "malformed JSON",
    b'{"samples": 5}': "'samples' list",
    b'{"samples": [1]}': "samples[0] is not an object",
    b'{"samples": [{"prompt": "p", "response": "r", "finish_reason": "maybe"}]}': "finish_reason must be one of",
    b'{"samples": [{"prompt": "p", "response": "r", "response_ids": [-1]}]}': "response_ids must be a list of token ids",
    b'{"samples": [{"prompt": "p", "response": NaN}]}': "non-finite number NaN",
    b'[]': "'samples' list",
    # issue 44 item 1: 600 levels (3.6 KB) broke the worker pool for good (500 on every later request)
    b'{"samples": [{"prompt": "p", "response": "r", "metadata": ' + b'{"a": ' * 600 + b"{}" + b"}" * 600 + b"}]}":
        "samples[0].metadata nests lists/objects deeper than 100 levels",
}


def test_every_malformed_body_gets_400_with_the_reason(server):
    srv = server("text_hash_reward")
    for body, reason in MALFORMED.items():
        status, reply, _ = post(srv.url, body)
        assert status == 400 and reason in reply["error"], (body[:60], status, reply)
    assert post(srv.url, samples("a"))[0] == 200  # and the next request is served
    assert srv.alive()


@pytest.mark.parametrize("fn, response, error", [
    ("exits", "exit", "raised SystemExit: 3"),
    ("interrupts", "exit", "raised KeyboardInterrupt"),
    ("kills_itself", "die", "worker process died"),
    ("dies", "die", "raised SystemExit: os._exit(7) called by a reward function"),
    ("exits_cleanly", "bye", "raised SystemExit: os._exit(0) called by a reward function"),
    ("posix_exits", "bye", "worker process died (Abnormal termination (exit code 0 while running a call); exit code 0)"),
    ("hangs_forever", "hang", "timed out after 1 s"),
    ("huge", "huge", "beyond float32's range"),
])
def test_a_misbehaving_function_is_that_samples_error_and_the_server_goes_on(server, fn, response, error):
    srv = server(fn, "--timeout-s", "1", "--concurrency", "1")
    status, body, _ = post(srv.url, samples("a", response, "b"))
    assert status == 200 and body["scores"][0] == 1.0 and body["scores"][1] is None and error in body["errors"][1], body
    assert post(srv.url, samples("c"))[:2] == (200, {"api_version": 1, "scores": [1.0], "errors": [None]})
    assert srv.alive()


@pytest.mark.slow
def test_a_thousand_concurrent_clients(server):
    """1,000 clients at once, each one request with its own prompt (retrying on 503 after
    Retry-After, at most 60 attempts): each gets exactly one 200 with its own score; the server's
    memory and thread count stay bounded throughout."""
    import zlib

    import aiohttp

    srv = server("text_hash_reward", "--concurrency", "2", "--max-in-flight", "32")
    base = srv.status()
    peak = dict(base)
    clients, replies, busy = 1000, {}, [0]

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        body = json.dumps({"samples": [{"prompt": "p", "response": f"client {i}"}]})
        for _ in range(60):
            async with session.post(srv.url + "/v1/score", data=body, headers={"Content-Type": "application/json"}) as r:
                if r.status == 503:
                    busy[0] += 1
                    await asyncio.sleep(float(r.headers["Retry-After"]) * (0.5 + (i % 10) / 10))
                    continue
                assert i not in replies
                replies[i] = (r.status, await r.json())
                return

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            for k, v in srv.status().items():
                peak[k] = max(peak[k], v)
            await asyncio.sleep(0.2)

    async def main() -> float:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        t0 = time.monotonic()
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=90)) as session:
            await asyncio.gather(*(client(session, i) for i in range(clients)))
        stop.set()
        await watcher
        return time.monotonic() - t0

    wall = asyncio.run(main())
    assert sorted(replies) == list(range(clients))  # none lost
    for i, (status, body) in replies.items():
        expected = (zlib.crc32(f"client {i}".encode()) % 1000) / 1000.0
        assert status == 200 and body["scores"] == [expected], (i, status, body)  # its own answer, not another's
    import urllib.request

    with urllib.request.urlopen(srv.url + "/v1/info", timeout=10) as r:
        served = json.loads(r.read())["replies"]
    assert served == ({"200": clients, "503": busy[0]} if busy[0] else {"200": clients})  # each scored exactly once
    assert peak["threads"] <= base["threads"] + 8, (base, peak)
    assert peak["rss_kb"] <= base["rss_kb"] + 200 * 1024, (base, peak)
    assert srv.alive() and wall < 100
    print(f"1000 clients: {wall:.1f} s, {busy[0]} answers 503 (retried), server RSS {base['rss_kb'] // 1024} -> "
          f"{peak['rss_kb'] // 1024} MiB at most, threads {base['threads']} -> {peak['threads']} at most")
