"""``tidal serve-reward``: host a reward model or a Python reward function behind JSON API v1.

The API is in :mod:`tidal.rewards.protocol` and docs/rewards.md. Binds 127.0.0.1 unless told
otherwise; with a token, every request must carry ``Authorization: Bearer <token>``.
A per-sample failure (a raising or timed-out function, a non-finite model score) is reported in
``errors[i]`` with ``scores[i] = null``; the client decides whether that stops training.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import sys
from typing import Awaitable, Callable

import torch
from aiohttp import web

from tidal.config_base import ConfigError
from tidal.rewards import protocol
from tidal.rewards.base import ComponentResult
from tidal.rewards.types import RewardSample

Scorer = Callable[[list[RewardSample]], Awaitable[ComponentResult]]


def build_app(scorer: Scorer, *, info: dict, token: str | None = None, max_batch_size: int = 1024) -> web.Application:
    """The aiohttp application: POST /v1/score, GET /v1/info."""

    def authorised(request: web.Request) -> bool:
        if token is None:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def error(status: int, message: str) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.Response(status=status, body=protocol.dumps({"error": message}), content_type="application/json", headers=headers)

    async def score(request: web.Request) -> web.Response:
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        try:
            samples = protocol.decode_request(await request.read())
        except protocol.ProtocolError as e:
            return error(400, str(e))
        if len(samples) > max_batch_size:
            return error(413, f"{len(samples)} samples in one request; this server takes at most {max_batch_size}")
        try:
            result = await scorer(samples)
        except Exception as e:  # the scorer itself failed (not one sample): a server error
            return error(500, f"{type(e).__name__}: {e}")
        return web.Response(body=protocol.encode_response(result.scores, result.errors), content_type="application/json")

    async def get_info(request: web.Request) -> web.Response:
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        body = {"api_version": protocol.API_VERSION, "max_batch_size": max_batch_size, **info}
        return web.Response(body=protocol.dumps(body), content_type="application/json")

    app = web.Application(client_max_size=256 * 1024**2)
    app.router.add_post(protocol.SCORE_PATH, score)
    app.router.add_get(protocol.INFO_PATH, get_info)
    return app


def function_scorer(path: str, *, timeout_s: float, concurrency: int) -> Scorer:
    from tidal.rewards.config import FunctionRewardConfig
    from tidal.rewards.function import FunctionReward

    comp = FunctionReward(FunctionRewardConfig(path=path, timeout_s=timeout_s, concurrency=concurrency), key="--function")
    return comp.score_async


def model_scorer(args: argparse.Namespace) -> Scorer:
    """A resident reward model; one scoring call at a time, off the event loop."""
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tidal serve-reward", description="Serve a reward model or function (JSON API v1).")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="local directory of a sequence-classification reward model (num_labels=1)")
    what.add_argument("--function", help="reward function as module:function")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (visible in ps; prefer --token-env)")
    tok.add_argument("--token-env", help="name of an environment variable holding the required bearer token")
    p.add_argument("--max-batch-size", type=int, default=1024, help="most samples per request (more: HTTP 413)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="--function: time limit per sample")
    p.add_argument("--concurrency", type=int, default=8, help="--function: calls in flight at once")
    p.add_argument("--tokenizer", help="--model: tokenizer directory (default: the model's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="--model: device")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="--model: dtype")
    p.add_argument("--micro-batch-size", type=int, default=8, help="--model: sequences per forward pass")
    p.add_argument("--max-length", type=int, default=4096, help="--model: tokens per sequence (left-truncated)")
    p.add_argument("--separator", default=None, help="--model: text between prompt and response (default: the one recorded by Tidal's reward-model training, else empty)")
    return p.parse_args(argv)


def _resolve_token(args: argparse.Namespace) -> str | None:
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise ConfigError("--token-env", f"environment variable '{args.token_env}' is unset or empty")
        return token
    return args.token or None


async def serve(app: web.Application, host: str, port: int, *, ready: Callable[[int], None], stop: asyncio.Event) -> None:
    """Run ``app`` on host:port until ``stop`` is set; ``ready(port)`` is called once listening."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
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
        if args.function:
            scorer = function_scorer(args.function, timeout_s=args.timeout_s, concurrency=args.concurrency)
            info = {"kind": "function", "target": args.function}
        else:
            scorer = model_scorer(args)
            info = {"kind": "model", "target": os.path.basename(os.path.normpath(args.model))}
    except ConfigError as e:
        print(f"tidal serve-reward: {e}", file=sys.stderr)
        return 2
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"tidal serve-reward: warning: serving on {args.host} without a token", file=sys.stderr)
    app = build_app(scorer, info=info, token=token, max_batch_size=args.max_batch_size)

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
