"""Tidal's token-logprob API, version 1: what a remote distillation teacher serves.

``POST /v1/token_logprobs`` with ``{"sequences": [{"prompt_ids": [int], "response_ids": [int]}, ...]}``.
Reply 200: ``{"api_version": 1, "logprobs": [[number, ...] | null, ...], "errors": [null | str, ...]}``,
one entry per sequence, in order: ``logprobs[i][t] = log p_teacher(response_ids[t] | prompt_ids +
response_ids[:t])`` (temperature 1), exactly ``len(response_ids)`` finite numbers, or null exactly
when ``errors[i]`` says why. Errors: ``{"error": str}`` with 400 (malformed request), 401 (token),
413 (too large), 500. ``GET /v1/info``: ``{"api_version": 1, "tokenizer_sha256": str, "max_batch_size": int, ...}``;
a student refuses a teacher whose tokenizer fingerprint differs from its own
(:func:`tidal.models.loading.tokenizer_fingerprint`).
"""

from __future__ import annotations

import math
from typing import Any

from tidal.rewards.protocol import ProtocolError, dumps, loads

API_VERSION = 1
LOGPROBS_PATH = "/v1/token_logprobs"
INFO_PATH = "/v1/info"


def encode_request(prompts: list[list[int]], responses: list[list[int]]) -> bytes:
    return dumps({"sequences": [{"prompt_ids": list(p), "response_ids": list(r)} for p, r in zip(prompts, responses)]})


def _ids(obj: Any, where: str) -> list[int]:
    if not isinstance(obj, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in obj):
        raise ProtocolError(f"{where} must be a list of non-negative integers")
    return obj


def decode_request(body: bytes) -> tuple[list[list[int]], list[list[int]]]:
    obj = loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("sequences"), list):
        raise ProtocolError("request must be an object with a 'sequences' list")
    prompts, responses = [], []
    for i, seq in enumerate(obj["sequences"]):
        if not isinstance(seq, dict) or set(seq) != {"prompt_ids", "response_ids"}:
            raise ProtocolError(f"sequences[{i}] must be an object with exactly 'prompt_ids' and 'response_ids'")
        prompts.append(_ids(seq["prompt_ids"], f"sequences[{i}].prompt_ids"))
        responses.append(_ids(seq["response_ids"], f"sequences[{i}].response_ids"))
        if not prompts[-1]:
            raise ProtocolError(f"sequences[{i}].prompt_ids is empty")
    return prompts, responses


def encode_response(logprobs: list[list[float] | None], errors: dict[int, str]) -> bytes:
    out_lp, out_err = [], []
    for i, lp in enumerate(logprobs):
        err = errors.get(i)
        if err is None and (lp is None or not all(math.isfinite(v) for v in lp)):
            err = "non-finite logprob"
        out_lp.append(None if err else lp)
        out_err.append(err)
    return dumps({"api_version": API_VERSION, "logprobs": out_lp, "errors": out_err})


def decode_response(body: bytes, lengths: list[int]) -> tuple[list[list[float] | None], dict[int, str]]:
    """(per-sequence logprobs or None, errors by position) from a 200 reply for sequences whose
    responses have ``lengths`` tokens; ProtocolError when the reply breaks the API."""
    obj = loads(body)
    if not isinstance(obj, dict) or obj.get("api_version") != API_VERSION:
        raise ProtocolError(f"reply is not a token-logprob API v{API_VERSION} object")
    lps, errs = obj.get("logprobs"), obj.get("errors", [None] * len(lengths))
    if not isinstance(lps, list) or len(lps) != len(lengths) or not isinstance(errs, list) or len(errs) != len(lengths):
        raise ProtocolError(f"reply must have 'logprobs' and 'errors' lists of {len(lengths)} entries")
    out, errors = [], {}
    for i, (lp, n) in enumerate(zip(lps, lengths)):
        if lp is None:
            errors[i] = f"teacher: {errs[i]}" if isinstance(errs[i], str) and errs[i] else "teacher returned null without an error"
            out.append(None)
            continue
        if not isinstance(lp, list) or len(lp) != n:
            got = f"{len(lp)} logprobs" if isinstance(lp, list) else repr(lp)[:40]
            raise ProtocolError(f"reply logprobs[{i}] has {got} for a response of {n} tokens")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= 1e-6 for v in lp):
            raise ProtocolError(f"reply logprobs[{i}] holds a value that is not a finite log-probability (<= 0)")
        out.append([float(v) for v in lp])
    return out, errors
