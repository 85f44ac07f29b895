"""HTTP client of a reward service speaking API v1 (see :mod:`tidal.rewards.protocol`).

Samples go out in batches of ``batch_size``, at most ``concurrency`` requests in flight -- each
lowered to what the server advertises in ``GET /v1/info`` (``max_batch_size``, ``max_in_flight``),
asked once per session. A request attempt that times out, cannot connect, or gets HTTP 408/500/502/504
is retried up to ``max_retries`` times with exponential backoff, jittered; a server that answers busy
(503 or 429) is waited for instead -- ``Retry-After`` jittered upwards, so that clients told the same
wait do not come back together -- for up to ``retry_deadline_s`` from the batch's first attempt, and
those waits do not count as retries. After that every sample of the batch has an error (never a
score of 0). A reply that breaks the protocol (malformed JSON, wrong number of scores, non-numbers,
or longer than :func:`max_reply_bytes` of its batch, read no further) is an error of the whole batch
without retries. 401/403 mean the token is wrong or missing: that is a configuration error and
raises at once, whatever ``on_error`` says.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time

import aiohttp

from tidal.config_base import check
from tidal.rewards import protocol
from tidal.rewards.base import AsyncComponent, ComponentResult, RewardError
from tidal.rewards.config import RemoteRewardConfig
from tidal.rewards.types import RewardSample

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
BUSY_STATUSES = frozenset({429, 503})  # the server is up and says when to come back
_ERROR_DETAIL_BYTES = 4096  # of a non-200 reply's body, kept for the message
_REPLY_ENVELOPE_BYTES = 64 * 1024
_REPLY_BYTES_PER_SAMPLE = 16 * 1024  # a score and an error message of up to ~16 KiB


def max_reply_bytes(n: int) -> int:
    """The longest reply accepted for a batch of ``n`` samples (a score and an error message each)."""
    return _REPLY_ENVELOPE_BYTES + n * _REPLY_BYTES_PER_SAMPLE


class Retryable(Exception):
    """An attempt that may succeed when repeated (timeout, connection error, HTTP 408/429/5xx);
    ``busy``: the server answered 503/429 (it is up; come back after ``retry_after``)."""

    def __init__(self, message: str, retry_after: float | None = None, busy: bool = False):
        super().__init__(message)
        self.retry_after = retry_after
        self.busy = busy


def _retry_after(headers) -> float | None:
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return None


def backoff_seconds(attempt: int, retry_after: float | None, base_s: float, max_s: float) -> float:
    """The wait before retry ``attempt``: ``Retry-After`` (capped at ``max_s``) jittered to
    100-150% when the server gave one (never sooner than it asked; clients told the same wait
    spread out), else ``min(max_s, base_s * 2**attempt)`` jittered to 50-100%."""
    if retry_after is not None:
        return min(max_s, retry_after) * random.uniform(1.0, 1.5)
    return min(max_s, base_s * 2**attempt) * random.uniform(0.5, 1.0)


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None as soon as it is known to be longer than ``limit`` (read no further)."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    parts, size = [], 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def post_once(session: aiohttp.ClientSession, url: str, payload: bytes, timeout_s: float, *,
                    max_bytes: int | None = None) -> bytes:
    """One POST attempt: the 200 reply's body; raises Retryable (timeout, connection error,
    408/429/5xx), RewardError (401/403: a configuration error) or ProtocolError (another status, or
    a 200 reply longer than ``max_bytes``, which is read no further)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.post(url, data=payload, timeout=timeout) as resp:
            status, headers = resp.status, resp.headers
            limit = max_bytes if status == 200 else _ERROR_DETAIL_BYTES
            body = await _read_at_most(resp, limit if limit is not None else math.inf)
    except asyncio.TimeoutError:
        raise Retryable(f"timed out after {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise Retryable(f"{type(e).__name__}: {e}") from None
    if status == 200:
        if body is None:
            raise protocol.ProtocolError(f"reply longer than {max_bytes} bytes")
        return body
    detail = (body or b"(a long body)")[:200].decode(errors="replace")
    if status in RETRY_STATUSES:
        raise Retryable(f"HTTP {status}: {detail}", _retry_after(headers), busy=status in BUSY_STATUSES)
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
        self._advertised: dict | None = None  # the server's /v1/info limits, asked once per session

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.cfg.concurrency)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
            self._advertised = None
        return self._session

    async def _limits(self) -> tuple[int, int]:
        """(batch size, requests in flight): the config's, lowered to what the server advertises in
        ``GET /v1/info`` (``max_batch_size``, ``max_in_flight``); a server that does not say (or
        cannot be asked now) leaves them as configured."""
        session = self._get_session()
        if self._advertised is None:
            self._advertised = {}
            try:
                timeout = aiohttp.ClientTimeout(total=min(self.cfg.timeout_s, 10.0))
                async with session.get(self.cfg.url.rstrip("/") + protocol.INFO_PATH, timeout=timeout) as resp:
                    body = await _read_at_most(resp, _REPLY_ENVELOPE_BYTES) if resp.status == 200 else None
                info = protocol.loads(body) if body is not None else {}
                self._advertised = {k: v for k, v in (info if isinstance(info, dict) else {}).items()
                                    if k in ("max_batch_size", "max_in_flight") and isinstance(v, int) and v >= 1}
            except (asyncio.TimeoutError, aiohttp.ClientError, protocol.ProtocolError):
                pass  # asked again with the next session; the retries below meet a server that is down
        batch = min(self.cfg.batch_size, self._advertised.get("max_batch_size", self.cfg.batch_size))
        return batch, min(self.cfg.concurrency, self._advertised.get("max_in_flight", self.cfg.concurrency))

    def deadline_s(self, n: int) -> float:
        """Every attempt of every batch through ``concurrency`` slots, each at most ``timeout_s``,
        plus the backoff waits of one batch's retries and its waits for a busy server."""
        attempts = math.ceil(n / self.cfg.batch_size) * (self.cfg.max_retries + 1)
        return (math.ceil(attempts / self.cfg.concurrency) * self.cfg.timeout_s + self.cfg.max_retries * self.cfg.max_backoff_s
                + self.cfg.retry_deadline_s)

    def detach_loop(self) -> None:
        self._session = None  # it belongs to the abandoned loop; the next call opens a new one

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score_async(self, samples: list[RewardSample]) -> ComponentResult:
        if not samples:
            return ComponentResult(scores=[])
        bs, in_flight = await self._limits()
        sem = asyncio.Semaphore(in_flight)
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
        last, attempts, retries, busy = "", 0, 0, False
        busy_until = time.monotonic() + self.cfg.retry_deadline_s
        while True:
            attempts += 1
            try:
                async with sem:  # a slot per attempt: backoff waits do not hold one
                    scores, errors = await self._post(payload, len(batch))
                return ComponentResult(scores=scores, errors=errors, counters={"retries": float(retries)})
            except protocol.ProtocolError as e:
                msg = f"remote reward {self.cfg.score_url}: bad reply: {e}"
                return ComponentResult.failed(len(batch), msg, retries=float(retries), failed_requests=1.0)
            except Retryable as e:
                last, busy = str(e), busy or e.busy
                wait = backoff_seconds(retries, e.retry_after, self.cfg.backoff_s, self.cfg.max_backoff_s)
                if e.busy and time.monotonic() + wait < busy_until:  # the server is up: waiting is not a failed attempt
                    await asyncio.sleep(wait)
                    continue
                if retries >= self.cfg.max_retries:
                    break
                retries += 1
                await asyncio.sleep(wait)
        msg = f"remote reward {self.cfg.score_url}: failed after {attempts} attempts; last: {last}"
        if busy:
            msg += f" (a busy server is waited for up to retry_deadline_s={self.cfg.retry_deadline_s:g})"
        return ComponentResult.failed(len(batch), msg, retries=float(retries), failed_requests=1.0)

    async def _post(self, payload: bytes, n: int) -> tuple[list[float], dict[int, str]]:
        """One attempt: (scores, errors), or Retryable / ProtocolError / RewardError."""
        try:
            body = await post_once(self._get_session(), self.cfg.score_url, payload, self.cfg.timeout_s,
                                   max_bytes=max_reply_bytes(n))
        except RewardError as e:
            raise RewardError(f"remote reward {e}") from None
        return protocol.decode_response(body, n)
