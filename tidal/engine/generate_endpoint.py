"""The engine's token-level generate endpoint: vLLM's ``POST /inference/v1/generate``, which the
training clients of the ``verifiers`` stack call (``verifiers.v1.TrainClient`` through
``renderers.client.generate``), served from Tidal's own engine so their traces carry the engine's
exact token ids and sampling logprobs.

Protocol (what ``renderers.client.generate`` sends and parses):

- ``POST /inference/v1/generate`` ``{"model", "token_ids": [prompt ids], "sampling_params":
  {"max_tokens", "stop_token_ids", "logprobs", "temperature"?, "top_p"?, "top_k"?, ...}}`` ->
  ``{"request_id", "prompt_token_ids", "choices": [{"index": 0, "token_ids": [...],
  "logprobs": {"content": [{"token": "token_id:<id>", "logprob": x}, ...]}, "finish_reason":
  "stop" | "length"}], "usage": {...}}``. The ids are the engine's sampled ids (a stop token
  included, as vLLM returns it) and each logprob the engine's sampling logprob, as a JSON float
  (a float32 value survives the round trip exactly).
- ``GET /v1/models``: the one model, with ``max_model_len`` (the client's overlong-prompt check).

The sampling filter is the run's (``rollout.temperature``, ``top_p``, ``top_k``): the trainer
scores the tokens with it, so a request asking for another filter is refused (HTTP 400, saying
which) rather than sampled from a distribution the trainer does not know. ``max_tokens`` (at most
the run's ``rollout.max_new_tokens``) and ``stop_token_ids`` are per request.

Threads: the HTTP server runs on an event loop of its own thread; each request waits in a queue
until the engine's owner drains it with :meth:`GenerateEndpoint.serve` on its own thread (the
engine never leaves the thread that owns it), which batches whatever is waiting into
``generate`` calls. Binds 127.0.0.1 on a free port (no fixed ports: the engine shares a process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import threading
from typing import Any, Callable

from tidal.engine.base import Completion, SamplingParams

GENERATE_PATH = "/inference/v1/generate"
_FILTER = ("temperature", "top_p", "top_k")


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400 with this message)."""


@dataclasses.dataclass(kw_only=True)
class _Pending:
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    answer: concurrent.futures.Future


def parse_request(body: Any, run: SamplingParams, max_model_len: int) -> tuple[list[int], int, tuple[int, ...]]:
    """(prompt ids, max tokens, stop ids) of a generate request body; RequestError saying what is
    wrong (module docstring: the run's sampling filter, one completion, a prompt that fits)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise RequestError("token_ids must be a non-empty list of token ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object")
    for name in _FILTER:
        asked, ours = sp.get(name), getattr(run, name)
        if asked is not None and float(asked) != float(ours):
            raise RequestError(f"sampling_params.{name}={asked} differs from the run's {ours} (rollout.{name}): the trainer "
                               "scores the tokens with the run's sampling filter")
    if int(sp.get("n", 1) or 1) != 1:
        raise RequestError("sampling_params.n must be 1 (one completion per request)")
    if sp.get("logprobs") not in (None, 0, 1):
        raise RequestError("sampling_params.logprobs: only the sampled token's logprob is returned (logprobs <= 1)")
    max_tokens = sp.get("max_tokens")
    max_tokens = run.max_new_tokens if max_tokens is None else int(max_tokens)
    if not 1 <= max_tokens <= run.max_new_tokens:
        raise RequestError(f"sampling_params.max_tokens={max_tokens} must be in [1, {run.max_new_tokens}] (rollout.max_new_tokens)")
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens; the model has {max_model_len} positions")
    stop = sp.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(i, int) for i in stop):
        raise RequestError("sampling_params.stop_token_ids must be a list of token ids")
    return list(ids), min(max_tokens, max_model_len - len(ids)), tuple(sorted(set(stop)))


def response_body(request_id: str, completion: Completion) -> dict:
    """The generate response of ``completion`` (module docstring)."""
    ids = list(completion.token_ids)
    return {
        "request_id": request_id,
        "prompt_token_ids": list(completion.prompt_ids),
        "choices": [{
            "index": 0,
            "token_ids": ids,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": float(lp)} for t, lp in zip(ids, completion.logprobs)]},
            "finish_reason": "stop" if completion.finish_reason == "stop" else "length",
        }],
        "usage": {"prompt_tokens": len(completion.prompt_ids), "completion_tokens": len(ids),
                  "total_tokens": len(completion.prompt_ids) + len(ids)},
    }


class GenerateEndpoint:
    """The endpoint (module docstring). ``model``: the name ``/v1/models`` lists and requests give;
    ``max_model_len``: the model's positions. ``served`` keeps every completion it answered with,
    in order (what a trace must match)."""

    def __init__(self, *, model: str, max_model_len: int):
        self.model, self.max_model_len = model, max_model_len
        self.served: list[Completion] = []
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._ids = itertools.count()
        self._run: SamplingParams | None = None
        self._calls = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidal-generate-endpoint", daemon=True)
        self._thread.start()
        self._runner, self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    @property
    def url(self) -> str:
        """The server's root (``/inference/v1/generate`` and ``/v1/models`` are under it)."""
        return f"http://127.0.0.1:{self.port}"

    async def _start(self):
        from aiohttp import web

        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post(GENERATE_PATH, self._generate)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "tidal",
                                                              "max_model_len": self.max_model_len}]})

    async def _generate(self, request):
        from aiohttp import web

        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        run = self._run
        if run is None:
            return web.json_response({"error": {"message": "the engine is not serving now (no rollout in progress)"}}, status=503)
        try:
            ids, max_tokens, stop = parse_request(body, run, self.max_model_len)
        except RequestError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
        pending = _Pending(prompt_ids=ids, max_tokens=max_tokens, stop_token_ids=stop, answer=concurrent.futures.Future())
        self._queue.put(pending)
        try:
            completion = await asyncio.wrap_future(pending.answer)
        except Exception as e:  # noqa: BLE001 -- the engine's failure, said to the client and raised on the engine's side
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=500)
        return web.json_response(response_body(f"tidal-{next(self._ids)}", completion))

    def serve(self, generate: Callable[..., list[Completion]], params: SamplingParams, until: Callable[[], bool],
              poll_s: float = 0.002) -> None:
        """Answer requests with ``generate(prompts, SamplingParams)`` (the engine's) on this
        thread until ``until()`` is true: each round takes every waiting request and generates them
        in one call per (max tokens, stop ids). ``params``: the run's sampling (its filter and seed)."""
        self._run = params
        try:
            while not until():
                batch = self._take(poll_s)
                groups: dict[tuple[int, tuple[int, ...]], list[_Pending]] = {}
                for p in batch:
                    groups.setdefault((p.max_tokens, p.stop_token_ids), []).append(p)
                for (max_tokens, stop), group in groups.items():
                    self._answer(generate, dataclasses.replace(params, n=1, max_new_tokens=max_tokens, seed=self._call_seed(params.seed),
                                                               stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(stop)))), group)
        finally:
            self._run = None

    def _call_seed(self, seed: int | None) -> int | None:
        """A seed of its own for each ``generate`` call: an engine keys its random numbers by the
        seed and a sequence's place in the call, so two calls with the run's seed would draw the
        same numbers for their first sequences (the samples of one prompt, asked in two rounds,
        would coincide)."""
        self._calls += 1
        return None if seed is None else (seed * 1_000_003 + self._calls) % 2**62

    def _take(self, poll_s: float) -> list[_Pending]:
        try:
            batch = [self._queue.get(timeout=poll_s)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def _answer(self, generate, params: SamplingParams, group: list[_Pending]) -> None:
        try:
            completions = generate([p.prompt_ids for p in group], params)
        except BaseException as e:
            for p in group:
                p.answer.set_exception(e)
            raise
        for p, c in zip(group, completions):
            self.served.append(c)
            p.answer.set_result(c)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the server and its thread."""
        try:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
