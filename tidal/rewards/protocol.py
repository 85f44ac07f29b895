"""Tidal's reward-service JSON API, version 1 (shared by the client and ``tidal serve-reward``).

``POST /v1/score`` with ``{"samples": [SAMPLE, ...]}``; SAMPLE is
``{"prompt": str, "response": str, "prompt_ids": [int], "response_ids": [int], "reference": any,
"label": str, "metadata": object, "finish_reason": "stop"|"length", "messages": [{"role": str,
"content": str, ...}]}`` (only prompt and response are required; ``messages``, the whole conversation
of a multi-turn trajectory, is sent only when the sample has it, so older servers keep working on
single-turn samples). Reply 200: ``{"api_version": 1, "scores": [number|null, ...], "errors": [null|str, ...]}``
with one entry per sample, in order; ``scores[i]`` is null exactly when ``errors[i]`` says why.
Errors: ``{"error": str}`` with 400 (malformed request), 401 (missing/wrong bearer token),
408 (body too slow), 413 (body too large, or too many samples), 503 (busy; ``Retry-After``),
500 (server failure). ``GET /v1/info`` describes the service and its limits. Bodies are UTF-8.
See docs/rewards.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from tidal.rewards.base import cut_message, score_problem
from tidal.rewards.types import MAX_NESTING, RewardSample, nesting_depth

API_VERSION = 1
SCORE_PATH = "/v1/score"
FINISH_REASONS = ("stop", "length")
INFO_PATH = "/v1/info"


class ProtocolError(ValueError):
    """A request or reply does not follow API v1."""


def _reject_constant(name: str) -> float:
    raise ProtocolError(f"non-finite number {name} in JSON")


def loads(body: bytes | str) -> Any:
    """Strict JSON (UTF-8): NaN/Infinity are rejected; anything that is not JSON -- invalid UTF-8,
    nesting too deep to parse -- is a ProtocolError saying why."""
    try:
        text = body.decode("utf-8") if isinstance(body, (bytes, bytearray)) else body  # not json's encoding sniffing
        return json.loads(text, parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except json.JSONDecodeError as e:
        raise ProtocolError(f"malformed JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ProtocolError(f"body is not UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal too long to convert
        raise ProtocolError(f"malformed JSON: {e}") from None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False).encode()


def sample_to_json(s: RewardSample) -> dict[str, Any]:
    out = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "index"}
    if out["messages"] is None:
        del out["messages"]
    return out


def encode_request(samples: list[RewardSample]) -> bytes:
    try:
        return dumps({"samples": [sample_to_json(s) for s in samples]})
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"a sample's reference/metadata is not JSON-serialisable: {e}") from None


_FIELD_TYPES = {
    "prompt": str,
    "response": str,
    "prompt_ids": list,
    "response_ids": list,
    "label": str,
    "metadata": dict,
    "finish_reason": str,
    "messages": list,
}


def sample_from_json(obj: Any, i: int) -> RewardSample:
    if not isinstance(obj, dict):
        raise ProtocolError(f"samples[{i}] is not an object")
    unknown = sorted(set(obj) - set(_FIELD_TYPES) - {"reference"})
    if unknown:
        raise ProtocolError(f"samples[{i}] has unknown field '{unknown[0]}'")
    for name in ("prompt", "response"):
        if name not in obj:
            raise ProtocolError(f"samples[{i}] lacks '{name}'")
    for name, tp in _FIELD_TYPES.items():
        if name in obj and not isinstance(obj[name], tp):
            raise ProtocolError(f"samples[{i}].{name} must be a JSON {tp.__name__}")
    for name in ("prompt_ids", "response_ids"):
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in obj.get(name, [])):
            raise ProtocolError(f"samples[{i}].{name} must be a list of token ids (integers >= 0)")
    if obj.get("finish_reason", "stop") not in FINISH_REASONS:
        raise ProtocolError(f"samples[{i}].finish_reason must be one of {list(FINISH_REASONS)}")
    for k, m in enumerate(obj.get("messages", [])):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProtocolError(f"samples[{i}].messages[{k}] must be an object with a string 'role'")
    for name in ("reference", "metadata", "messages"):  # what a worker process is handed, pickled
        if nesting_depth(obj.get(name)) > MAX_NESTING:
            raise ProtocolError(f"samples[{i}].{name} nests lists/objects deeper than {MAX_NESTING} levels")
    return RewardSample(index=i, **{"prompt_ids": [], "response_ids": [], **obj})


def decode_request(body: bytes) -> list[RewardSample]:
    obj = loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("samples"), list):
        raise ProtocolError("request must be an object with a 'samples' list")
    return [sample_from_json(s, i) for i, s in enumerate(obj["samples"])]


def encode_response(scores: list[float], errors: dict[int, str]) -> bytes:
    out_scores: list[float | None] = []
    out_errors: list[str | None] = []
    for i, v in enumerate(scores):
        problem = score_problem(v)
        err = errors.get(i) or (None if problem is None else f"score {problem}")
        out_scores.append(None if err else v)
        out_errors.append(err)
    return dumps({"api_version": API_VERSION, "scores": out_scores, "errors": out_errors})


def decode_response(body: bytes, n: int) -> tuple[list[float], dict[int, str]]:
    """(scores, errors by position) from a 200 reply for n samples; ProtocolError if it is invalid."""
    obj = loads(body)
    if not isinstance(obj, dict):
        raise ProtocolError("reply is not a JSON object")
    if obj.get("api_version") != API_VERSION:
        raise ProtocolError(f"reply api_version is {obj.get('api_version')!r}, this client speaks {API_VERSION}")
    scores, errors = obj.get("scores"), obj.get("errors", [None] * n)
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else f"scores={scores!r:.60}"
        raise ProtocolError(f"reply has {got} for {n} samples")
    if not isinstance(errors, list) or len(errors) != n:
        raise ProtocolError(f"reply 'errors' must be a list of {n} entries")
    out, errs = [], {}
    for i, (v, e) in enumerate(zip(scores, errors)):
        if v is None:
            errs[i] = cut_message(f"server: {e}") if isinstance(e, str) and e else "server returned null without an error"
            out.append(math.nan)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(f"reply scores[{i}] is {v!r:.60}, not a number")
        else:
            try:
                problem = score_problem(float(v))
            except OverflowError:
                problem = "an integer beyond float's range"
            if problem is not None:  # invalid like NaN: this sample's error, not a score
                errs[i] = f"server returned {problem}"
                out.append(math.nan)
            else:
                out.append(float(v))
    return out, errs
