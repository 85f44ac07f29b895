"""Test-only fault injection, driven by the ``TIDAL_FAULT`` environment variable (read here only).

With ``TIDAL_FAULT`` unset or empty every hook is a no-op: :func:`hit` returns at once and
:func:`corrupt` returns its tensor unchanged. The variable is parsed once, at import; a malformed
value raises ``ValueError`` then (a fault test must not silently run fault-free).

Grammar: ``TIDAL_FAULT = RULE[;RULE...]``, ``RULE = ACTION@POINT[:key=value...]``.

ACTION
    ``kill``    SIGKILL this process (a crashed rank: no cleanup, no exception).
    ``hang``    sleep forever (a rank that never enters its next collective).
    ``enospc``  raise ``OSError(ENOSPC)`` (a full disk at that point).
    ``nan`` / ``inf``  :func:`corrupt` returns the tensor plus NaN / +Inf (gradients flow).
    ``sigterm`` / ``sigint``  send this process SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C).
    ``record``  append ``{"point", "step", "rank", "attempt", "data"}`` as one JSON line to
                ``<dir>/rank<R>.jsonl`` (needs ``dir=``); an observation, not a fault.
POINT
    ``stage/<name>``: entry of a trainer stage (the watchdog's stages: ``setup``, ``resume``, the
    timed phases ``generate``, ``reward``, ``train``, ``checkpoint``, ...); ``checkpoint/<when>``:
    inside :func:`tidal.run.checkpoint.save_checkpoint` (``begin``, ``shards``, ``marker``,
    ``swapped``, ``renamed``, ``rotating``); ``policy_logp``: the actor's logprobs in the update (for ``nan``);
    ``sampled``: the prompt (or, in the reward-model job, pair) indices a rank takes for a step
    (for ``record``); ``rm_scores``: the reward model's scores of the chosen replies in its
    training step (for ``nan``); ``sft``: after SFT step ``step`` of a task build, counted over all
    its phases (:func:`tidal.tasks.sft.train_masked`).
keys
    ``rank=R`` (default: every rank), ``step=S`` / ``S-`` / ``S-E`` (default: every step),
    ``attempt=A`` or ``any``: torchrun's restart count ``TORCHELASTIC_RESTART_COUNT`` (default 0,
    so a killed run restarted by ``torchrun --max-restarts`` is not killed again), ``dir=PATH``.

Example: ``TIDAL_FAULT="kill@stage/train:rank=1:step=3"`` kills rank 1 when step 3's update starts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import time
from typing import Any

ENV = "TIDAL_FAULT"
ACTIONS = ("kill", "hang", "enospc", "nan", "inf", "record", "sigterm", "sigint")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    action: str
    point: str
    rank: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    attempt: int | None = 0  # None: every attempt
    dir: str | None = None

    def matches(self, point: str, step: int | None, rank: int) -> bool:
        if point != self.point or (self.rank is not None and rank != self.rank):
            return False
        if self.attempt is not None and attempt() != self.attempt:
            return False
        if self.first_step is not None and (step is None or step < self.first_step):
            return False
        return self.last_step is None or (step is not None and step <= self.last_step)


def _parse_steps(text: str) -> tuple[int | None, int | None]:
    if text.endswith("-"):
        return int(text[:-1]), None
    if "-" in text:
        a, b = text.split("-", 1)
        return int(a), int(b)
    return int(text), int(text)


def parse(spec: str) -> list[Rule]:
    """Rules of a ``TIDAL_FAULT`` value (see the module docstring); ValueError when malformed."""
    rules = []
    for text in filter(None, (r.strip() for r in spec.split(";"))):
        head, *opts = text.split(":")
        action, sep, point = head.partition("@")
        if not sep or action not in ACTIONS or not point:
            raise ValueError(f"{ENV}: rule {text!r} must look like ACTION@POINT[:key=value...] with ACTION in {ACTIONS}")
        kw: dict[str, Any] = {"action": action, "point": point}
        for opt in opts:
            key, sep, value = opt.partition("=")
            try:
                if key == "rank":
                    kw["rank"] = int(value)
                elif key == "step":
                    kw["first_step"], kw["last_step"] = _parse_steps(value)
                elif key == "attempt":
                    kw["attempt"] = None if value == "any" else int(value)
                elif key == "dir":
                    kw["dir"] = value
                else:
                    raise ValueError(f"unknown key {key!r}")
            except ValueError as e:
                raise ValueError(f"{ENV}: rule {text!r}: bad option {opt!r} ({e})") from None
        if action == "record" and not kw.get("dir"):
            raise ValueError(f"{ENV}: rule {text!r}: record needs dir=PATH")
        rules.append(Rule(**kw))
    return rules


_RULES: list[Rule] = parse(os.environ.get(ENV, ""))
_step: int | None = None


def enabled() -> bool:
    return bool(_RULES)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _rank(rank: int | None) -> int:
    return int(os.environ.get("RANK", "0")) if rank is None else rank


def set_step(step: int) -> None:
    """The current training step, for rules with ``step=`` at points that do not know it."""
    global _step
    _step = step


def hit(point: str, *, step: int | None = None, rank: int | None = None, data: Any = None) -> None:
    """Run the ``kill`` / ``hang`` / ``enospc`` / ``sigterm`` / ``sigint`` / ``record`` rules matching
    ``point`` (no-op when unset)."""
    if not _RULES:
        return
    step, rank = (_step if step is None else step), _rank(rank)
    for rule in _RULES:
        if not rule.matches(point, step, rank):
            continue
        if rule.action == "record":
            _record(rule.dir, {"point": point, "step": step, "rank": rank, "attempt": attempt(), "data": data})
        elif rule.action == "kill":
            print(f"[tidal.faults] SIGKILL rank {rank} at {point} step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif rule.action == "hang":
            print(f"[tidal.faults] rank {rank} hangs at {point} step {step}", flush=True)
            while True:
                time.sleep(3600)
        elif rule.action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV} at {point})")
        elif rule.action in ("sigterm", "sigint"):
            print(f"[tidal.faults] {rule.action.upper()} to rank {rank} at {point} step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM if rule.action == "sigterm" else signal.SIGINT)


def corrupt(point: str, tensor, *, step: int | None = None, rank: int | None = None):
    """``tensor`` plus NaN or +Inf when a ``nan`` / ``inf`` rule matches ``point``, else ``tensor``."""
    if not _RULES:
        return tensor
    step, rank = (_step if step is None else step), _rank(rank)
    for rule in _RULES:
        if rule.action in ("nan", "inf") and rule.matches(point, step, rank):
            return tensor + (math.nan if rule.action == "nan" else math.inf)
    return tensor


def _record(directory: str, row: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rank{row['rank']}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())  # a kill may follow
