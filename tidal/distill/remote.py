"""Client of a remote distillation teacher (token-logprob API v1, :mod:`tidal.distill.protocol`).

Sequences go out in batches of ``model.teacher.batch_size``, at most ``concurrency`` requests in
flight, each attempt retried like a remote reward's (timeout, connection error, HTTP 408/429/5xx;
exponential backoff). A batch that still fails, or a reply that breaks the API, marks its sequences
as errors: the caller applies ``reward.on_error`` (raise, or drop and count), never a logprob of 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

import aiohttp

from tidal.config_base import ConfigError, check
from tidal.distill import protocol
from tidal.models.config import TeacherConfig
from tidal.rewards.protocol import ProtocolError
from tidal.rewards.remote import Retryable, backoff_seconds, post_once

BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0


class RemoteTeacher:
    """``token_logprobs(prompts, responses) -> (logprobs per sequence or None, errors by position, counters)``."""

    def __init__(self, cfg: TeacherConfig, *, key: str = "model.teacher"):
        self.cfg = cfg
        self.url = cfg.url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if cfg.token_env is not None:
            token = os.environ.get(cfg.token_env, "")
            check(bool(token), f"{key}.token_env", f"environment variable '{cfg.token_env}' is unset or empty")
            self.headers["Authorization"] = f"Bearer {token}"

    def info(self) -> dict:
        """The endpoint's ``GET /v1/info`` (at setup: a down endpoint is a ConfigError naming the url)."""
        req = urllib.request.Request(self.url + protocol.INFO_PATH, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                info = json.loads(resp.read())
        except (OSError, ValueError) as e:
            raise ConfigError("model.teacher.url", f"cannot read {self.url}{protocol.INFO_PATH}: {e}") from None
        if not isinstance(info, dict) or info.get("api_version") != protocol.API_VERSION or "tokenizer_sha256" not in info:
            raise ConfigError("model.teacher.url", f"{self.url} does not speak the token-logprob API v{protocol.API_VERSION}: {info!r:.200}")
        return info

    def token_logprobs(self, prompts: list[list[int]], responses: list[list[int]]):
        return asyncio.run(self._all(prompts, responses))

    async def _all(self, prompts, responses):
        bs = self.cfg.batch_size
        sem = asyncio.Semaphore(self.cfg.concurrency)
        connector = aiohttp.TCPConnector(limit=self.cfg.concurrency)
        async with aiohttp.ClientSession(connector=connector, headers=self.headers) as session:
            parts = await asyncio.gather(*(
                self._batch(session, sem, prompts[i : i + bs], responses[i : i + bs]) for i in range(0, len(prompts), bs)
            ))
        out, errors, counters = [], {}, {"retries": 0.0, "failed_requests": 0.0}
        for lps, errs, cnt in parts:
            errors.update({len(out) + i: m for i, m in errs.items()})
            out.extend(lps)
            for k, v in cnt.items():
                counters[k] += v
        return out, errors, counters

    async def _batch(self, session, sem, prompts, responses):
        payload = protocol.encode_request(prompts, responses)
        lengths = [len(r) for r in responses]
        url, last = self.url + protocol.LOGPROBS_PATH, ""
        for attempt in range(self.cfg.max_retries + 1):
            try:
                async with sem:
                    body = await post_once(session, url, payload, self.cfg.timeout_s)
                lps, errs = protocol.decode_response(body, lengths)
                return lps, errs, {"retries": float(attempt)}
            except ProtocolError as e:
                return self._failed(len(prompts), f"teacher {url}: bad reply: {e}", attempt)
            except Retryable as e:
                last = str(e)
                if attempt < self.cfg.max_retries:
                    await asyncio.sleep(backoff_seconds(attempt, e.retry_after, BACKOFF_S, MAX_BACKOFF_S))
        return self._failed(len(prompts), f"teacher {url}: failed after {self.cfg.max_retries + 1} attempts; last: {last}",
                            self.cfg.max_retries)

    @staticmethod
    def _failed(n: int, msg: str, attempt: int):
        return [None] * n, {i: msg for i in range(n)}, {"retries": float(attempt), "failed_requests": 1.0}
