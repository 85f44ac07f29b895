"""The tool-use quickstart: `tidal train calculator` (shipped config, unchanged) teaches the tiny
model to call the calculator tool: held-out greedy accuracy and the tool-call rate rise clearly."""

import json
import os
import re
import subprocess
import sys

import pytest


def announced(stdout: str, when: str) -> dict[str, float]:
    """The metrics of the "[tidal] eval at <when>" line and its environment line."""
    lines = stdout.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(f"[tidal] eval at {when}:"))
    text = lines[i] + (", " + lines[i + 1] if i + 1 < len(lines) and "environment:" in lines[i + 1] else "")
    return {k: float(v) for k, v in re.findall(r"([\w/@]+) (-?[0-9.]+)\b", text.split(": ", 1)[1])}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 3 minutes on two idle cores (task build 80 s, 40 steps); more on a shared machine
def test_calculator_learns_to_call_the_tool(tmp_path, task_workdir):
    cmd = [sys.executable, "-m", "tidal.cli", "train", "calculator", f"run.output_dir={tmp_path / 'run'}",
           f"task.workdir={task_workdir}", "logging.backends=[jsonl]"]
    # One thread, the thread rule's choice on two cores. Which way the run goes at lr 1e-3 is decided by float
    # rounding: with OMP_NUM_THREADS=2 on the shared development machine and the same built model, 9e119a6 fell from
    # reward 0.45 (step 6) to 0.07 (step 9) and 9d9ee04, before the merges, from 0.16 (step 1) to 0.00 (step 7),
    # both into malformed tool calls (tool errors 0.27-0.29 of trajectories); engine and trainer logprobs agree to
    # 4e-7 and the sampler's draws pass a chi-square test at either thread count (issue 51 item 9). At lr 1e-3 the
    # update is at the edge of stability: with optim.lr=5e-4 1 and 2 threads give the same evaluations (seed 1:
    # greedy 0.01 -> 0.45 -> 0.65 -> 0.93 at steps 10/20/30; 0.95 at 40 with 2 threads) and no run collapsed, but
    # seed 2 learned slower (0.44 at step 40, short of this test's +0.5), so the shipped lr is not changed yet.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "carries no signal" not in proc.stdout + proc.stderr  # it starts at 0 by design, and learns (issue 44 item 13)
    start, end = announced(proc.stdout, "start"), announced(proc.stdout, "end")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["eval/greedy_accuracy"] == pytest.approx(start["greedy_accuracy"], rel=5e-3)  # the start evaluation
    rows = rows[1:]
    assert rows[-1]["step"] == 40 and rows[-1]["eval/greedy_accuracy"] == pytest.approx(end["greedy_accuracy"], rel=5e-3)  # printed to 3 digits
    # the warm start answers alone (wrong) when greedy: it must learn to call the tool
    assert start["greedy_accuracy"] <= 0.2 and start.get("tool_calls_frac", 0.0) <= 0.2, start
    assert end["greedy_accuracy"] >= start["greedy_accuracy"] + 0.5, (start, end)  # measured 0.00 -> 0.96
    assert end["tool_calls_frac"] >= start.get("tool_calls_frac", 0.0) + 0.5, (start, end)  # measured 0.00 -> 1.00
    first, last = rows[0]["reward/mean"], sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert last > first + 0.2, (first, last)
    assert rows[0]["env/tool_calls_frac"] < rows[-1]["env/tool_calls_frac"]
    for key in ("env/turns_mean", "env/tool_failures", "env/wait_s", "env/finish/max_turns_frac", "env/truncated_turns_frac"):
        assert key in rows[-1], key
