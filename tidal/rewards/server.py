"""``tidal serve-reward``: host a reward model or a Python reward function behind JSON API v1.

The API is in :mod:`tidal.rewards.protocol` and docs/rewards.md. Binds 127.0.0.1 unless told
otherwise; with a token, every request must carry ``Authorization: Bearer <token>``.
A per-sample failure (a raising or timed-out function, a non-finite model score) is reported in
``errors[i]`` with ``scores[i] = null``; the client decides whether that stops training.

What the server takes is bounded (:class:`ServerLimits`): a body is at most
``max_batch_size x max_sample_kb`` (413 as soon as it is known to be larger, while reading, before
any parsing); at most ``max_in_flight`` requests are read, parsed and scored at once (503 with
``Retry-After`` beyond, in seconds the queue of turned-away clients is likely to take:
:class:`BusyEstimate`); a connection that sends no complete request head within ``idle_timeout_s``
of opening or of its last reply is closed, and a body must arrive within ``body_timeout_s`` (408).
A function runs in a pool of worker processes: a call past its limit is killed with its worker,
which is replaced; whatever a function does (raise ``SystemExit``, exit, hang) is that sample's
error and the server goes on. Every malformed request gets 400 with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hmac
import math
import os
import signal
import sys
import time
from typing import Awaitable, Callable

from aiohttp import web

from tidal.config_base import ConfigError, check
from tidal.rewards import protocol
from tidal.rewards.base import ComponentResult
from tidal.rewards.types import RewardSample

Scorer = Callable[[list[RewardSample]], Awaitable[ComponentResult]]
_ENVELOPE_BYTES = 64 * 1024  # '{"samples": [...]}' and separators, beyond the samples themselves
_READ_CHUNK = 64 * 1024
STATS = web.AppKey("stats", dict)  # replies by status, requests in flight
LIMITS = web.AppKey("limits", object)


@dataclasses.dataclass(kw_only=True)
class ServerLimits:
    """What one ``tidal serve-reward`` process accepts (each is a command-line option).

    max_batch_size: most samples per request (more: 413; Tidal's client sends ``batch_size``, 32).
    max_sample_kb: the JSON of one sample may take this many KiB; with ``max_batch_size`` it sets
        the body limit, ``max_body_bytes``.
    max_in_flight: requests being read, parsed or scored at once; more get 503 with ``Retry-After``.
        Memory is bounded by about ``max_in_flight x max_body_bytes`` (x the JSON's expansion once
        parsed, up to ~6 for token-id lists).
    idle_timeout_s: a connection is closed when it has not sent a complete request head this long
        after opening or after its previous reply (slow or idle clients).
    body_timeout_s: time to receive one request's body once its head has arrived (408 past it).
    """

    max_batch_size: int = 64
    max_sample_kb: int = 256
    max_in_flight: int = 16
    idle_timeout_s: float = 15.0
    body_timeout_s: float = 30.0

    def __post_init__(self):
        check(self.max_batch_size >= 1, "--max-batch-size", "must be >= 1")
        check(self.max_sample_kb >= 1, "--max-sample-kb", "must be >= 1")
        check(self.max_in_flight >= 1, "--max-in-flight", "must be >= 1")
        check(0 < self.idle_timeout_s <= 3600, "--idle-timeout-s", "must be in (0, 3600]")
        check(0 < self.body_timeout_s <= 3600, "--body-timeout-s", "must be in (0, 3600]")

    @property
    def max_body_bytes(self) -> int:
        return self.max_batch_size * self.max_sample_kb * 1024 + _ENVELOPE_BYTES


class BusyEstimate:
    """What a 503's ``Retry-After`` says: about when a slot is free for a client turned away now.

    ``wait_s = request_s x (1 + turned_away / max_in_flight)``: ``request_s`` is the moving average
    of how long a request took (scored, or rejected after reading), ``turned_away`` the 503s of the
    last ``max(1, 2 x request_s)`` seconds -- the clients that will come back before this one --
    served ``max_in_flight`` at a time. In whole seconds (the header's unit), 1 to 60."""

    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self.request_s = 1.0
        self._turned_away: collections.deque[float] = collections.deque()

    def finished(self, seconds: float) -> None:
        self.request_s = 0.8 * self.request_s + 0.2 * seconds

    def turn_away(self) -> int:
        """Record a 503 now; the ``Retry-After`` to send with it."""
        now = time.monotonic()
        window = max(1.0, 2 * self.request_s)
        while self._turned_away and self._turned_away[0] < now - window:
            self._turned_away.popleft()
        self._turned_away.append(now)
        wait = self.request_s * (1 + len(self._turned_away) / self.max_in_flight)
        return int(min(60, max(1, math.ceil(wait))))


class _Reject(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


async def _read_body(request: web.Request, limits: ServerLimits) -> bytes:
    """The body, or _Reject(413) as soon as it is known to exceed the limit, or _Reject(408)."""
    limit = limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _Reject(413, f"body of {request.content_length} bytes; this server takes at most {limit} "
                      f"(--max-batch-size {limits.max_batch_size} x --max-sample-kb {limits.max_sample_kb})")

    async def read() -> bytes:
        parts, size = [], 0
        async for chunk in request.content.iter_chunked(_READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise _Reject(413, f"body larger than {limit} bytes (--max-batch-size x --max-sample-kb)")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise _Reject(408, f"body not received within {limits.body_timeout_s:g} s") from None


def build_app(scorer: Scorer, *, info: dict, token: str | None = None, limits: ServerLimits | None = None) -> web.Application:
    """The aiohttp application: POST /v1/score, GET /v1/info. ``app[STATS]`` counts replies by status."""
    limits = limits or ServerLimits()
    stats = {"in_flight": 0, "replies": {}}
    busy = BusyEstimate(limits.max_in_flight)

    def authorised(request: web.Request) -> bool:
        if token is None:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(errors="surrogateescape"), f"Bearer {token}".encode())

    def reply(status: int, body: dict | bytes, headers: dict | None = None) -> web.Response:
        stats["replies"][status] = stats["replies"].get(status, 0) + 1
        data = body if isinstance(body, bytes) else protocol.dumps(body)
        return web.Response(status=status, body=data, content_type="application/json", headers=headers)

    def error(status: int, message: str, headers: dict | None = None) -> web.Response:
        if status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        return reply(status, {"error": message}, headers)

    async def score(request: web.Request) -> web.Response:
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        if stats["in_flight"] >= limits.max_in_flight:
            busy_reply = error(503, f"busy: {limits.max_in_flight} requests in flight (--max-in-flight); retry",
                               {"Retry-After": str(busy.turn_away())})
            # the client comes back after Retry-After, when an idle keep-alive connection may have been
            # closed under it (idle_timeout_s): it reconnects instead of writing into a closed socket
            busy_reply.force_close()
            return busy_reply
        stats["in_flight"] += 1
        started = time.monotonic()
        try:
            return await _score(request)
        except _Reject as e:
            return error(e.status, str(e), e.headers)
        finally:
            stats["in_flight"] -= 1
            busy.finished(time.monotonic() - started)

    async def _score(request: web.Request) -> web.Response:
        body = await _read_body(request, limits)
        try:
            samples = protocol.decode_request(body)
        except protocol.ProtocolError as e:
            return error(400, str(e))
        if len(samples) > limits.max_batch_size:
            return error(413, f"{len(samples)} samples in one request; this server takes at most {limits.max_batch_size}")
        try:
            result = await scorer(samples)
        except Exception as e:  # the scorer itself failed (not one sample): a server error
            return error(500, f"{type(e).__name__}: {e}")
        return reply(200, protocol.encode_response(result.scores, result.errors))

    async def get_info(request: web.Request) -> web.Response:
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        body = {"api_version": protocol.API_VERSION, "max_batch_size": limits.max_batch_size,
                "max_body_bytes": limits.max_body_bytes, "max_in_flight": limits.max_in_flight, **info,
                "replies": {str(k): v for k, v in sorted(stats["replies"].items())}}
        return web.json_response(body)

    app = web.Application(client_max_size=limits.max_body_bytes)
    app[STATS] = stats
    app[LIMITS] = limits
    app.router.add_post(protocol.SCORE_PATH, score)
    app.router.add_get(protocol.INFO_PATH, get_info)
    return app


def function_component(path: str, *, timeout_s: float, concurrency: int):
    """The served function as a :class:`~tidal.rewards.function.FunctionReward` in a process pool
    (``score_async`` scores, ``aclose`` stops the workers)."""
    from tidal.rewards.config import FunctionRewardConfig
    from tidal.rewards.function import FunctionReward

    cfg = FunctionRewardConfig(path=path, timeout_s=timeout_s, concurrency=concurrency, isolation="process")
    return FunctionReward(cfg, key="--function")


def model_scorer(args: argparse.Namespace) -> Scorer:
    """A resident reward model; one scoring call at a time, off the event loop."""
    import torch

    from tidal.rewards.config import ModelRewardConfig
    from tidal.rewards.model import ModelReward
    from tidal.rewards.placement import LocalPlacement

    device = torch.device(args.device)
    cfg = ModelRewardConfig(
        path=args.model, tokenizer=args.tokenizer, micro_batch_size=args.micro_batch_size,
        max_length=args.max_length, dtype=args.dtype, separator=args.separator,
    )
    comp = ModelReward(cfg, device=device, placement=LocalPlacement(device), key="--model", resident=True)
    lock = asyncio.Lock()

    async def score(samples: list[RewardSample]) -> ComponentResult:
        async with lock:
            return await asyncio.to_thread(comp.score, samples)

    return score


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str]) -> argparse.Namespace:
    d = ServerLimits()
    p = argparse.ArgumentParser(prog="tidal serve-reward", description="Serve a reward model or function (JSON API v1).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="local directory of a sequence-classification reward model (num_labels=1)")
    what.add_argument("--function", help="reward function as module:function")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (visible in ps; prefer --token-env)")
    tok.add_argument("--token-env", help="name of an environment variable holding the required bearer token")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="most samples per request (more: HTTP 413)")
    p.add_argument("--max-sample-kb", type=int, default=d.max_sample_kb, help="KiB of JSON per sample; x max-batch-size = body limit (413)")
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight, help="requests handled at once (more: HTTP 503, Retry-After)")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s, help="close a connection without a request head for this long")
    p.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s, help="time to receive a request body (HTTP 408)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="--function: time limit per call (the worker is killed past it)")
    p.add_argument("--concurrency", type=int, default=8, help="--function: worker processes")
    p.add_argument("--tokenizer", help="--model: tokenizer directory (default: the model's)")
    p.add_argument("--device", default=None, help="--model: device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="--model: dtype")
    p.add_argument("--micro-batch-size", type=int, default=8, help="--model: sequences per forward pass")
    p.add_argument("--max-length", type=int, default=4096, help="--model: tokens per sequence (left-truncated)")
    p.add_argument("--separator", default=None, help="--model: text between prompt and response (default: the one recorded by Tidal's reward-model training, else empty)")
    args = p.parse_args(argv)
    if args.model and args.device is None:
        args.device = _default_device()
    return args


def _resolve_token(args: argparse.Namespace) -> str | None:
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise ConfigError("--token-env", f"environment variable '{args.token_env}' is unset or empty")
        return token
    return args.token or None


async def serve(app: web.Application, host: str, port: int, *, ready: Callable[[int], None], stop: asyncio.Event) -> None:
    """Run ``app`` on host:port until ``stop`` is set; ``ready(port)`` is called once listening."""
    limits = app.get(LIMITS) or ServerLimits()
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.idle_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    ready(runner.addresses[0][1])  # the real port when port=0
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    """Entry point of ``tidal serve-reward``; returns the exit status."""
    args = parse_args(argv)
    try:
        token = _resolve_token(args)
        limits = ServerLimits(max_batch_size=args.max_batch_size, max_sample_kb=args.max_sample_kb, max_in_flight=args.max_in_flight,
                              idle_timeout_s=args.idle_timeout_s, body_timeout_s=args.body_timeout_s)
        component = None
        if args.function:
            component = function_component(args.function, timeout_s=args.timeout_s, concurrency=args.concurrency)
            scorer, info = component.score_async, {"kind": "function", "target": args.function}
        else:
            scorer = model_scorer(args)
            info = {"kind": "model", "target": os.path.basename(os.path.normpath(args.model))}
    except ConfigError as e:
        print(f"tidal serve-reward: {e}", file=sys.stderr)
        return 2
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"tidal serve-reward: warning: serving on {args.host} without a token", file=sys.stderr)
    app = build_app(scorer, info=info, token=token, limits=limits)
    if component is not None:

        async def stop_workers(_app: web.Application) -> None:
            await component.aclose()

        app.on_cleanup.append(stop_workers)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(port: int) -> None:
            print(f"tidal serve-reward: listening on http://{args.host}:{port} (api v{protocol.API_VERSION}, {info['kind']})", flush=True)

        await serve(app, args.host, args.port, ready=ready, stop=stop)

    try:
        asyncio.run(run())
    except OSError as e:  # e.g. the port is taken
        print(f"tidal serve-reward: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0
