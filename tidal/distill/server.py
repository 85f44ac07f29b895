"""``tidal serve-teacher``: a local HF causal LM behind the token-logprob API v1 (:mod:`tidal.distill.protocol`),
for on-policy distillation from a teacher that lives on another machine or GPU.

Binds 127.0.0.1 unless told otherwise; with a token, every request must carry
``Authorization: Bearer <token>``. One scoring call runs at a time, off the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import sys

import torch
from aiohttp import web

from tidal.config_base import ConfigError
from tidal.distill import protocol
from tidal.dtypes import resolve_dtype
from tidal.models.loading import load_causal_lm, load_tokenizer, tokenizer_fingerprint
from tidal.models.logprobs import token_logprobs
from tidal.rewards.protocol import ProtocolError, dumps

# bytes of a request body this server reads at most: max_batch_size sequences of up to max_tokens
# ids, each id at most ~8 JSON bytes, plus framing
_BYTES_PER_ID = 8


class TeacherScorer:
    """Token logprobs of a frozen causal LM (temperature 1), micro-batched by a token budget."""

    def __init__(self, model: torch.nn.Module, device: torch.device, micro_batch_tokens: int = 8192):
        self.model, self.device, self.micro_batch_tokens = model.to(device).eval(), device, micro_batch_tokens
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], responses: list[list[int]]) -> tuple[list[list[float] | None], dict[int, str]]:
        out: list[list[float] | None] = [None] * len(prompts)
        errors: dict[int, str] = {}
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(responses[i]))
        batch: list[int] = []
        for i in order + [None]:
            if i is not None and self.max_positions and len(prompts[i]) + len(responses[i]) > self.max_positions:
                errors[i] = f"sequence of {len(prompts[i]) + len(responses[i])} tokens > the teacher's {self.max_positions} positions"
                continue
            longest = max([len(prompts[j]) + len(responses[j]) for j in batch] + [0 if i is None else len(prompts[i]) + len(responses[i])])
            if batch and (i is None or longest * (len(batch) + 1) > self.micro_batch_tokens):
                self._run(batch, prompts, responses, out)
                batch = []
            if i is not None:
                batch.append(i)
        return out, errors

    def _run(self, batch, prompts, responses, out) -> None:
        T = max(len(prompts[i]) + len(responses[i]) for i in batch)
        ids_BT = torch.zeros(len(batch), T, dtype=torch.long)
        mask_BT = torch.zeros(len(batch), T, dtype=torch.long)
        act_BT = torch.zeros(len(batch), T, dtype=torch.long)
        for b, i in enumerate(batch):
            seq = prompts[i] + responses[i]
            ids_BT[b, : len(seq)] = torch.tensor(seq)
            mask_BT[b, : len(seq)] = 1
            act_BT[b, len(prompts[i]) : len(seq)] = 1
        logp_BT, _ = token_logprobs(self.model, ids_BT.to(self.device), mask_BT.to(self.device), positions_BT=act_BT.to(self.device))
        logp_BT = logp_BT.float().cpu()
        for b, i in enumerate(batch):
            P = len(prompts[i])
            out[i] = logp_BT[b, P : P + len(responses[i])].tolist()


def build_app(scorer, *, info: dict, token: str | None = None, max_batch_size: int = 256, max_tokens: int = 32768) -> web.Application:
    """The aiohttp application: ``POST /v1/token_logprobs``, ``GET /v1/info``."""
    lock = asyncio.Lock()

    def error(status: int, message: str) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.Response(status=status, body=dumps({"error": message}), content_type="application/json", headers=headers)

    def authorised(request: web.Request) -> bool:
        got = request.headers.get("Authorization", "")
        return token is None or hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    async def logprobs(request: web.Request) -> web.Response:
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        try:
            prompts, responses = protocol.decode_request(await request.read())
        except ProtocolError as e:
            return error(400, str(e))
        except web.HTTPRequestEntityTooLarge:
            return error(413, f"request body over {limit} bytes")
        if len(prompts) > max_batch_size:
            return error(413, f"{len(prompts)} sequences in one request; this server takes at most {max_batch_size}")
        try:
            async with lock:
                lps, errs = await asyncio.to_thread(scorer, prompts, responses)
        except Exception as e:  # the scorer itself failed: a server error
            return error(500, f"{type(e).__name__}: {e}")
        return web.Response(body=protocol.encode_response(lps, errs), content_type="application/json")

    async def get_info(request: web.Request) -> web.Response:
        if not authorised(request):
            return error(401, "missing or wrong bearer token")
        body = {"api_version": protocol.API_VERSION, "max_batch_size": max_batch_size, "max_tokens": max_tokens, **info}
        return web.Response(body=dumps(body), content_type="application/json")

    limit = max_batch_size * (max_tokens * _BYTES_PER_ID + 64) + 1024
    app = web.Application(client_max_size=limit)
    app.router.add_post(protocol.LOGPROBS_PATH, logprobs)
    app.router.add_get(protocol.INFO_PATH, get_info)
    return app


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tidal serve-teacher", description="Serve a teacher's token logprobs (token-logprob API v1).")
    p.add_argument("--model", required=True, help="local Hugging Face folder of the teacher (causal LM)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8001, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--token-env", help="name of an environment variable holding the required bearer token")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-batch-size", type=int, default=256, help="most sequences per request (more: HTTP 413)")
    p.add_argument("--max-tokens", type=int, default=32768, help="most tokens of one sequence a request may carry")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="padded tokens per forward pass")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Entry point of ``tidal serve-teacher``; returns the exit status."""
    args = parse_args(argv)
    try:
        token = None
        if args.token_env:
            token = os.environ.get(args.token_env, "")
            if not token:
                raise ConfigError("--token-env", f"environment variable '{args.token_env}' is unset or empty")
        device = torch.device(args.device)
        model = load_causal_lm(args.model, dtype=resolve_dtype(args.dtype, device), what="--model")
        fingerprint = tokenizer_fingerprint(load_tokenizer(args.model))
    except (ConfigError, ValueError) as e:
        print(f"tidal serve-teacher: {e}", file=sys.stderr)
        return 2
    info = {"kind": "teacher", "target": os.path.basename(os.path.normpath(args.model)), "tokenizer_sha256": fingerprint}
    app = build_app(TeacherScorer(model, device, args.micro_batch_tokens), info=info, token=token,
                    max_batch_size=args.max_batch_size, max_tokens=args.max_tokens)

    async def run() -> None:
        from tidal.rewards.server import serve

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(port: int) -> None:
            print(f"tidal serve-teacher: listening on http://{args.host}:{port} (token-logprob api v{protocol.API_VERSION})", flush=True)

        await serve(app, args.host, args.port, ready=ready, stop=stop)

    try:
        asyncio.run(run())
    except OSError as e:
        print(f"tidal serve-teacher: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0
