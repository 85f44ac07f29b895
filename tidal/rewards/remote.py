"""HTTP client of a reward service speaking API v1 (see :mod:`tidal.rewards.protocol`).

Samples go out in batches of ``batch_size``, at most ``concurrency`` requests in flight. A request
attempt that times out, cannot connect, or gets HTTP 408/429/5xx is retried up to ``max_retries``
times with exponential backoff; after that every sample of the batch has an error (never a score of
0). A reply that breaks the protocol (malformed JSON, wrong number of scores, non-numbers) is an
error of the whole batch without retries. 401/403 mean the token is wrong or missing: that is a
configuration error and raises at once, whatever ``on_error`` says.
"""

from __future__ import annotations

import asyncio
import math
import os
import random

import aiohttp

from tidal.config_base import check
from tidal.rewards import protocol
from tidal.rewards.base import AsyncComponent, ComponentResult, RewardError
from tidal.rewards.config import RemoteRewardConfig
from tidal.rewards.types import RewardSample

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class Retryable(Exception):
    """An attempt that may succeed when repeated (timeout, connection error, HTTP 408/429/5xx)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(headers) -> float | None:
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return None


def backoff_seconds(attempt: int, retry_after: float | None, base_s: float, max_s: float) -> float:
    """The wait before retry ``attempt``: ``Retry-After`` (capped) when the server gave one, else
    ``min(max_s, base_s * 2**attempt)`` jittered to 50-100%."""
    if retry_after is not None:
        return min(max_s, retry_after)
    return min(max_s, base_s * 2**attempt) * random.uniform(0.5, 1.0)


async def post_once(session: aiohttp.ClientSession, url: str, payload: bytes, timeout_s: float) -> bytes:
    """One POST attempt: the 200 reply's body; raises Retryable (timeout, connection error,
    408/429/5xx), RewardError (401/403: a configuration error) or ProtocolError (another status)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(url, data=payload, timeout=timeout) as resp:
            body = await resp.read()
            status, headers = resp.status, resp.headers
    except asyncio.TimeoutError:
        raise Retryable(f"timed out after {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise Retryable(f"{type(e).__name__}: {e}") from None
    if status == 200:
        return body
    detail = body[:200].decode(errors="replace")
    if status in RETRY_STATUSES:
        raise Retryable(f"HTTP {status}: {detail}", _retry_after(headers))
    if status in (401, 403):
        raise RewardError(f"{url}: HTTP {status} (bearer token missing or wrong; see token_env): {detail}")
    raise protocol.ProtocolError(f"HTTP {status}: {detail}")


class RemoteReward(AsyncComponent):
    """A remote reward service as a component. The HTTP session lives on the engine's event loop."""

    counter_names = ("retries", "failed_requests")

    def __init__(self, cfg: RemoteRewardConfig, *, key: str):
        self.cfg = cfg
        self.headers = {"Content-Type": "application/json"}
        if cfg.token_env is not None:
            token = os.environ.get(cfg.token_env, "")
            check(bool(token), f"{key}.token_env", f"environment variable '{cfg.token_env}' is unset or empty")
            self.headers["Authorization"] = f"Bearer {token}"
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.cfg.concurrency)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self._session

    def deadline_s(self, n: int) -> float:
        """Every attempt of every batch through ``concurrency`` slots, each at most ``timeout_s``,
        plus the backoff waits of one batch's retries."""
        attempts = math.ceil(n / self.cfg.batch_size) * (self.cfg.max_retries + 1)
        return math.ceil(attempts / self.cfg.concurrency) * self.cfg.timeout_s + self.cfg.max_retries * self.cfg.max_backoff_s

    def detach_loop(self) -> None:
        self._session = None  # it belongs to the abandoned loop; the next call opens a new one

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score_async(self, samples: list[RewardSample]) -> ComponentResult:
        if not samples:
            return ComponentResult(scores=[])
        sem = asyncio.Semaphore(self.cfg.concurrency)
        bs = self.cfg.batch_size
        parts = await asyncio.gather(*(self._score_batch(sem, samples[i : i + bs]) for i in range(0, len(samples), bs)))
        result = ComponentResult(scores=[], counters={"retries": 0.0, "failed_requests": 0.0})
        for part in parts:
            offset = len(result.scores)
            result.scores.extend(part.scores)
            result.errors.update({offset + i: msg for i, msg in part.errors.items()})
            for k, v in part.counters.items():
                result.counters[k] += v
        return result

    async def _score_batch(self, sem: asyncio.Semaphore, batch: list[RewardSample]) -> ComponentResult:
        try:
            payload = protocol.encode_request(batch)
        except protocol.ProtocolError as e:
            raise RewardError(f"remote reward {self.cfg.url}: {e}") from None
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            try:
                async with sem:  # a slot per attempt: backoff waits do not hold one
                    scores, errors = await self._post(payload, len(batch))
                return ComponentResult(scores=scores, errors=errors, counters={"retries": float(attempt)})
            except protocol.ProtocolError as e:
                msg = f"remote reward {self.cfg.score_url}: bad reply: {e}"
                return ComponentResult.failed(len(batch), msg, retries=float(attempt), failed_requests=1.0)
            except Retryable as e:
                last = str(e)
                if attempt < self.cfg.max_retries:
                    await asyncio.sleep(backoff_seconds(attempt, e.retry_after, self.cfg.backoff_s, self.cfg.max_backoff_s))
        msg = f"remote reward {self.cfg.score_url}: failed after {self.cfg.max_retries + 1} attempts; last: {last}"
        return ComponentResult.failed(len(batch), msg, retries=float(self.cfg.max_retries), failed_requests=1.0)

    async def _post(self, payload: bytes, n: int) -> tuple[list[float], dict[int, str]]:
        """One attempt: (scores, errors), or Retryable / ProtocolError / RewardError."""
        try:
            body = await post_once(self._get_session(), self.cfg.score_url, payload, self.cfg.timeout_s)
        except RewardError as e:
            raise RewardError(f"remote reward {e}") from None
        return protocol.decode_response(body, n)
