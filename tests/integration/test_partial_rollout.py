"""rollout.partial end to end on the tiny arithmetic task (native engine on CPU): with nothing cut it
is the plain rollout; with carry, stale tokens are trained and corrected, the correction's value
equal to its recomputation from the trained tokens' sampling and trainer logprobs; a carry run
stopped after step 3 and resumed gives the same step 4 as one that never stopped (the carried
sequences are in the checkpoint)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.algorithms.config import MismatchConfig

DETERMINISTIC = ("reward/", "actor/", "response/", "advantage/", "mismatch/", "partial/")
CARRY = ["rollout.partial.mode=carry", "algorithm.mismatch.mode=token_truncate", "rollout.partial.oversample=1.0"]


def _train(out: Path, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _metrics(out: Path, prefixes=DETERMINISTIC) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(prefixes) and not k.endswith("seconds")} for r in rows}


def _same(a: dict, b: dict, steps) -> None:
    for step in steps:
        assert a[step].keys() == b[step].keys(), step
        for k, v in a[step].items():
            assert v == pytest.approx(b[step][k], rel=1e-6, abs=1e-9), (step, k)


@pytest.mark.slow
def test_nothing_cut_equals_plain_rollout(tmp_path, tiny_task_overrides):
    """oversample 0: every group in flight completes, nothing is carried: the same requests, seeds
    and group ids as a plain rollout, so the same training."""
    common = tiny_task_overrides + ["run.steps=3", "optim.lr=1e-3", "algorithm.mismatch.mode=token_truncate"]
    _train(tmp_path / "plain", common)
    _train(tmp_path / "partial", common + ["rollout.partial.mode=carry", "rollout.partial.oversample=0"])
    plain = _metrics(tmp_path / "plain")
    partial = _metrics(tmp_path / "partial")
    for step in (1, 2, 3):
        p = partial[step]
        assert p["partial/carried"] == 0 and p["partial/stale_token_frac"] == 0 and p["partial/new_groups"] == 4
        partial[step] = {k: v for k, v in p.items() if not k.startswith("partial/")}
    _same(plain, partial, (1, 2, 3))


def _recomputed_correction(out: Path, step: int) -> tuple[float, float, float, float]:
    """From the step's trained rows (``logging.trajectories_every``: per token the engine's sampling
    logprob and the trainer's old logprob), over the tokens in the loss: the mean truncated
    importance weight ``min(exp(old - rollout), cap)`` (token_truncate), the same with the ratio
    inverted, the mean ``|old - rollout|``, and the largest ``|old - rollout|``."""
    cap = MismatchConfig(mode="token_truncate").cap
    w = inv = absd = worst = n = 0.0
    for line in (out / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines():
        row = json.loads(line)["trained"]
        for a, old, lp in zip(row["action_mask"], row["old_logprobs"], row["rollout_logprobs"]):
            if a * row["loss_mask"]:
                d = old - lp
                w, inv, absd, worst, n = w + min(math.exp(d), cap), inv + min(math.exp(-d), cap), absd + abs(d), max(worst, abs(d)), n + 1
    return w / n, inv / n, absd / n, worst


@pytest.mark.slow
def test_carry_trains_corrected_stale_tokens_and_resumes_exactly(tmp_path, tiny_task_overrides):
    # the old-logprob pass runs (recompute), so each step's rows hold both logprobs of every token
    common = tiny_task_overrides + CARRY + ["checkpoint.every=2", "checkpoint.keep=3", "optim.lr=3e-3",
                                            "train.old_logprobs=recompute", "logging.trajectories_every=1"]
    _train(tmp_path / "a", common + ["run.steps=4"])
    a = _metrics(tmp_path / "a")
    # partial rollout happened: groups carried, sequences resumed under new weights, and trained stale
    assert all(a[s]["partial/carried_groups"] > 0 for s in (1, 2, 3, 4))
    assert sum(a[s]["partial/resumed"] for s in (2, 3, 4)) > 0
    stale = [s for s in (2, 3, 4) if a[s]["partial/stale_token_frac"] > 0]
    assert stale and all(a[s]["partial/staleness_max"] >= 1 and a[s]["partial/span_max"] >= 2 for s in stale)
    # the correction's value is the one recomputed from the trained tokens' two logprobs, every step
    # (an inverted ratio, or logprobs misaligned with their tokens, give other values)
    moved = 0
    for s in (1, 2, 3, 4):
        w, inverted, absd, worst = _recomputed_correction(tmp_path / "a", s)
        assert a[s]["actor/mismatch_is_weight"] == pytest.approx(w, rel=1e-5), s
        assert a[s]["actor/mismatch_abs_logp_diff"] == pytest.approx(absd, rel=1e-4, abs=1e-9), s
        if s not in stale:  # every token sampled by the trained weights: the two logprobs agree token by token
            assert worst < 1e-4, s
        elif absd > 1e-3:  # stale tokens whose weights have moved since: the check tells a ratio from its inverse
            moved += 1
            assert abs(w - inverted) > 100 * 1e-5 * w, s
    assert moved  # some stale step trained tokens the weights had moved away from
    # exact resume: stop after step 3 (its checkpoint holds carried sequences with their tokens), resume to 4
    _train(tmp_path / "b", common + ["run.steps=3"])
    ckpt = json.loads((tmp_path / "b" / "checkpoints" / "step_000003" / "trainer.json").read_text())
    assert any(s["token_ids"] and s["finish_reason"] is None for g in ckpt["partial"][0]["groups"] for s in g["seqs"])
    _train(tmp_path / "b", common + ["run.steps=4"])
    b = _metrics(tmp_path / "b")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    _same(a, b, (1, 2, 3, 4))


@pytest.mark.slow
def test_drop_mode_trains(tmp_path, tiny_task_overrides):
    _train(tmp_path / "d", tiny_task_overrides + ["run.steps=2", "rollout.partial.mode=drop", "rollout.partial.oversample=1.0"])
    d = _metrics(tmp_path / "d")
    assert all(d[s]["partial/new_groups"] == 8 and d[s]["partial/dropped_groups"] == 4 for s in (1, 2))
    assert "partial/carried" not in d[1] and d[2]["partial/staleness_max"] == 0
