"""bench/grpo's workload matrix (``python -m bench.grpo matrix``): the natural length draws, the
cases and their selection, the case line on synthetic summaries, and a tiny CPU run of the matrix."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from bench.grpo import matrix, workloads
from bench.grpo.bounds import Ceilings, phase_bounds
from bench.grpo.shapes import SHAPES
from bench.grpo.workloads import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE_KEYS = {  # issue 20 item 1, issue 21 (predicted peak, first iteration, MFU), the engine's host time, agentic keys
    "figure", "commit", "device", "size", "seqs", "prompt_len", "max_new_tokens", "lengths", "partial_rollout",
    "iteration_s", "phases", "bounds", "real_tokens", "generated_tokens_per_s", "peak_allocated_gib", "peak_reserved_gib",
    "trl_iteration_s", "error", "predicted_peak_gib", "first_iteration_s", "mfu", "host_ms_per_decode_step",
    "device_ms_per_decode_step", "turns", "tool_latency_ms", "teacher_size",
}


def test_natural_lengths_are_seeded_heavy_tailed_and_bounded():
    a = workloads.natural_lengths(512, 1024, seed=1, rollout=0)
    assert a == workloads.natural_lengths(512, 1024, seed=1, rollout=0)  # the same for every framework
    assert a != workloads.natural_lengths(512, 1024, seed=1, rollout=1) != workloads.natural_lengths(512, 1024, seed=2, rollout=0)
    assert min(a) >= 1 and max(a) <= 1024 and all(isinstance(x, int) for x in a)
    many = workloads.natural_lengths(40000, 1024, seed=3, rollout=0)
    assert statistics.median(many) == pytest.approx(256, rel=0.03)  # median at max_new_tokens / 4
    assert sum(x == 1024 for x in many) / len(many) == pytest.approx(0.03, abs=0.005)  # ~3% cut at the maximum
    assert statistics.mean(many) > statistics.median(many)  # heavy right tail


def test_workload_lengths_and_validation():
    w = Workload(size="0.5b", prompts=64, samples=8, prompt_len=256, max_new_tokens=1024, lengths="natural")
    assert (w.seqs, w.name, w.partial_rollout) == (512, "0.5b-512x1024-natural", False)
    assert w.completion_lengths(2, seed=1) == workloads.natural_lengths(512, 1024, seed=1, rollout=2)
    forced = Workload(size="0.5b", prompts=2, samples=2, prompt_len=4, max_new_tokens=7)
    assert forced.completion_lengths(5, seed=1) == [7] * 4
    with pytest.raises(ValueError, match="size: unknown"):
        Workload(size="9b", prompts=1, samples=2, prompt_len=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="lengths must be"):
        Workload(size="tiny", prompts=1, samples=2, prompt_len=1, max_new_tokens=1, lengths="random")
    with pytest.raises(ValueError, match="samples must be >= 2"):
        Workload(size="tiny", prompts=1, samples=1, prompt_len=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Workload(size="0.5b", prompts=1, samples=2, prompt_len=256, max_new_tokens=32768)
    d = Workload(size="0.5b", prompts=64, samples=8, prompt_len=256, max_new_tokens=1024, lengths="natural", teacher="1.5b")
    assert d.name == "0.5b-512x1024-natural-distill1.5b" and d.completion_lengths(2, seed=1) == w.completion_lengths(2, seed=1)
    with pytest.raises(ValueError, match="teacher: unknown"):
        Workload(size="tiny", prompts=1, samples=2, prompt_len=1, max_new_tokens=1, teacher="2b")
    with pytest.raises(ValueError, match="another vocabulary"):  # 7b's vocabulary is not 0.5b's: another tokenizer
        Workload(size="0.5b", prompts=1, samples=2, prompt_len=1, max_new_tokens=1, teacher="7b")


def test_matrix_crosses_sizes_rollouts_lengths_and_modes():
    cases = workloads.matrix()
    assert len(cases) == 4 * 3 * 3 * (1 + 3) + 3 * 3 * 2 and len({w.name for w in cases}) == len(cases)
    assert {w.size for w in cases} == {"0.5b", "1.5b", "3b", "7b"}
    assert {(w.size, w.teacher) for w in cases if w.teacher} == {("0.5b", "1.5b")}
    assert {w.seqs for w in cases} == {128, 512, 2048} and {w.max_new_tokens for w in cases} == {256, 1024, 4096}
    assert {w.lengths for w in cases} == {"forced", "natural"} and {w.samples for w in cases} == {8}
    assert [w.size for w in cases] == sorted((w.size for w in cases), key=["0.5b", "1.5b", "3b", "7b"].index)
    picked = workloads.select(cases, ["0.5b-512x1024-*", "7b-512x1024-forced"])
    assert [w.name for w in picked] == ["0.5b-512x1024-forced", "0.5b-512x1024-natural", "0.5b-512x1024-natural-carry",
                                        "0.5b-512x1024-natural-drop", "0.5b-512x1024-forced-distill1.5b",
                                        "0.5b-512x1024-natural-distill1.5b", "7b-512x1024-forced"]
    assert [(w.rollout, w.partial_rollout) for w in picked[1:4]] == [("plain", False), ("carry", True), ("drop", True)]
    assert [w.name for w in workloads.select(cases, ["0.5b-512x1024-natural"])] == ["0.5b-512x1024-natural"]
    assert len(workloads.select(cases, ["*-distill1.5b"])) == 18
    with pytest.raises(ValueError, match="'0.5b-999x1-\\*' matches no case"):
        workloads.select(cases, ["0.5b-999x1-*"])
    assert [w.name for w in workloads.tiny_matrix()] == [
        "tiny-4x8-forced", "tiny-4x8-natural", "tiny-4x8-natural-carry", "tiny-4x8-natural-drop",
        "tiny-4x16-forced", "tiny-4x16-natural", "tiny-4x16-natural-carry", "tiny-4x16-natural-drop",
        "tiny-4x8-natural-distilltiny2"]
    with pytest.raises(ValueError, match="needs natural lengths"):
        Workload(size="tiny", prompts=1, samples=2, prompt_len=1, max_new_tokens=4, rollout="carry")
    w = Workload(size="tiny", prompts=2, samples=2, prompt_len=1, max_new_tokens=64, lengths="natural", rollout="drop")
    assert w.completion_lengths(0, 1) == workloads.natural_lengths(4, 64, seed=1, rollout=0)
    assert w.completion_lengths(0, 1, count=6) == workloads.natural_lengths(6, 64, seed=1, rollout=0)
    # TRL runs only plain cases (no distillation, no long-tail rollout); a --trl pattern naming only those is an error
    assert [w.name for w in matrix.trl_selection(picked, ["0.5b-*"])] == ["0.5b-512x1024-forced", "0.5b-512x1024-natural"]
    assert matrix.trl_selection(picked, []) == []
    with pytest.raises(ValueError, match="--trl .*'\\*distill\\*' matches no case"):
        matrix.trl_selection(picked, ["*distill*"])
    with pytest.raises(ValueError, match="--trl .*'\\*-carry' matches no case"):
        matrix.trl_selection(picked, ["*-carry"])
    assert matrix.case_timeout_s(picked[4]) == matrix.CASE_TIMEOUT_S["1.5b"] > matrix.case_timeout_s(picked[0])


def test_teacher_bound_is_the_teacher_forward_over_real_tokens():
    from bench.grpo.bounds import forward_flops

    c = Ceilings(copy_bw=1e12, matmul_flops=1e15)
    lengths = [1024, 100, 7, 300]
    plain = phase_bounds(SHAPES["0.5b"], prompt_len=256, unique_prompts=2, completion_lens=lengths, c=c,
                         old_logprobs=True, kl=False)
    distill = phase_bounds(SHAPES["0.5b"], prompt_len=256, unique_prompts=2, completion_lens=lengths, c=c,
                           old_logprobs=True, kl=False, teacher_shape=SHAPES["1.5b"])
    assert "teacher_logprobs" not in plain and {k: v for k, v in distill.items() if k != "teacher_logprobs"} == plain
    assert distill["teacher_logprobs"] == pytest.approx(forward_flops(SHAPES["1.5b"], 256, lengths) / 1e15)
    # the larger teacher's forward costs more than the student's; by hand: 2 N S over the body, the LM head on L
    assert distill["teacher_logprobs"] > distill["actor_logprobs"]
    s = SHAPES["1.5b"]
    h, q, kv = s["hidden_size"], s["hidden_size"], 2 * 128
    body = s["num_hidden_layers"] * (h * q + 2 * h * kv + q * h + 3 * h * s["intermediate_size"])
    seq = [256 + x for x in lengths]
    by_hand = (2 * body * sum(seq) + 2 * s["vocab_size"] * h * sum(lengths)
               + 2 * s["num_hidden_layers"] * q * sum(x * (x + 1) for x in seq))
    assert distill["teacher_logprobs"] == pytest.approx(by_hand / 1e15)


def _summary(steady, lengths, train_s):
    return {"steady_s": steady, "first_iteration_s": 30.0, "error": None, "checks": {"a": True}, "stopped_early": False,
            "phases": {"generate": 1.0, "train": train_s}, "phases_per_step": [{"generate": 1.0, "train": train_s}] * len(steady),
            "lengths_per_step": [lengths] * len(steady), "peak_allocated": 10 * 2**30, "peak_reserved": 12 * 2**30,
            "predicted_peak_gib": None, "engine_host": {"host": 0.9, "wait": 1.1, "engine_steps": 9}}


def test_case_line_from_synthetic_summaries():
    w = Workload(size="tiny", prompts=2, samples=2, prompt_len=8, max_new_tokens=4, lengths="natural")
    lengths = [4, 1, 2, 3]
    c = Ceilings(copy_bw=1e9, matmul_flops=1e12)
    per_step = [phase_bounds(SHAPES["tiny"], prompt_len=8, unique_prompts=2, completion_lens=lengths, c=c,
                             old_logprobs=False, kl=False)] * 3
    line = matrix.case_line(w, _summary([2.0, 1.0, 4.0], lengths, 0.5), None, shape=SHAPES["tiny"], ceilings=c,
                            bounds_per_step=per_step, tidal_set=["x=1"])
    assert line["iteration_s"] == 2.0 and line["first_iteration_s"] == 30.0 and line["error"] is None
    assert line["real_tokens"] == 8 * 4 + 10 and line["generated_tokens"] == 10
    assert line["generated_tokens_per_s"] == 5.0 and line["generate_tokens_per_s"] == 10.0
    assert line["bounds"] == per_step[0] and line["iteration_bound_s"] == pytest.approx(sum(per_step[0].values()))
    from bench.grpo.bounds import train_flops

    assert line["mfu"] == pytest.approx(train_flops(SHAPES["tiny"], 8, lengths) / (0.5 * 1e12))
    assert (line["host_ms_per_decode_step"], line["device_ms_per_decode_step"]) == (0.9, None)
    assert line["trl_iteration_s"] is None and line["turns"] is None and line["tool_latency_ms"] is None
    assert line["teacher_size"] is None
    assert line["peak_allocated_gib"] == 10.0 and line["ceilings"] == {"copy_bw_GBps": 1.0, "bf16_TFLOPs": 1.0}
    assert CASE_KEYS - {"figure", "commit", "device"} <= set(line)
    with_trl = matrix.case_line(w, _summary([2.0], lengths, 0.5), _summary([9.0, 11.0], lengths, 3.0), shape=SHAPES["tiny"],
                                ceilings=None, bounds_per_step=[], tidal_set=[])
    assert with_trl["trl_iteration_s"] == 10.0 and with_trl["mfu"] is None and with_trl["bounds"] == {}
    failed = matrix.case_line(w, {**_summary([], lengths, 0.5), "error": "OOM"}, None, shape=SHAPES["tiny"], ceilings=None,
                              bounds_per_step=[], tidal_set=[])
    assert failed["error"] == "OOM" and failed["iteration_s"] is None
    d = Workload(size="tiny", prompts=2, samples=2, prompt_len=8, max_new_tokens=4, lengths="natural", teacher="tiny2")
    distilled = matrix.case_line(d, _summary([2.0], lengths, 0.5), None, shape=SHAPES["tiny"], ceilings=None,
                                 bounds_per_step=[], tidal_set=[])
    assert distilled["teacher_size"] == "tiny2" and distilled["case"] == "tiny-4x4-natural-distilltiny2"


def _matrix(args, tmp_path, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "bench.grpo", "matrix", *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=ROOT)
    return out


def test_list_and_a_bad_case_pattern(tmp_path):
    out = _matrix(["--list", "--cases", "3b-2048x4096-*", "--trl", "3b-2048x4096-forced"], tmp_path)
    assert out.returncode == 0 and out.stdout.split("\n")[:2] == ["3b-2048x4096-forced  (+ TRL)", "3b-2048x4096-natural"]
    out = _matrix(["--list", "--cases", "0.5b-3x3-forced"], tmp_path)
    assert out.returncode != 0 and "matches no case" in out.stderr


@pytest.mark.slow
def test_tiny_matrix_on_cpu(tmp_path):
    record = tmp_path / "matrix.jsonl"
    out = _matrix(["--tiny", "--cases", "tiny-4x8-forced,tiny-4x8-natural,tiny-4x8-natural-carry,tiny-4x8-natural-drop", "--warmup", "0", "--steps", "1", "--record", str(record),
                   "--work-dir", str(tmp_path / "w"), "--commit", "abc"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert [x["case"] for x in lines] == ["tiny-4x8-forced", "tiny-4x8-natural", "tiny-4x8-natural-carry",
                                          "tiny-4x8-natural-drop"] and {x["figure"] for x in lines} == {"case"}
    for x in lines:
        assert CASE_KEYS <= set(x), CASE_KEYS - set(x)
        assert x["error"] is None and x["checks_ok"] is True, x
        assert x["commit"] == "abc" and x["device"] == "cpu" and x["run_id"] == lines[0]["run_id"]
        assert x["iteration_s"] > 0 and x["first_iteration_s"] == x["steady_s"][0] and {"generate", "train"} <= set(x["phases"])
        assert x["bounds"] == {} and x["mfu"] is None  # no ceilings on CPU
        assert x["trl_iteration_s"] is None and x["partial_rollout"] is (x["rollout_mode"] != "plain") and x["teacher_size"] is None
        assert "teacher_logprobs" not in x["phases"] and x["checks"]["teacher_iff_distill"] is True
    forced, natural, carry, drop = lines
    assert [x["rollout_mode"] for x in lines] == ["plain", "plain", "carry", "drop"]
    assert forced["partial"] is None and carry["partial"]["partial/new_groups"] >= 2 and "partial/carried" in carry["partial"]
    assert drop["partial"]["partial/new_groups"] == 3 and "partial/dropped_groups" in drop["partial"]
    assert carry["generated_tokens"] > 0 and "finish_stop" in carry["checks"] and "finish_stop" in drop["checks"]
    assert forced["generated_tokens"] == 4 * 8 and "finish_length" in forced["checks"]
    assert natural["generated_tokens"] < forced["generated_tokens"] and "finish_stop" in natural["checks"]


@pytest.mark.slow  # 9-12 s: two worker subprocesses (setup, Tidal), each importing torch
def test_tiny_distillation_case_on_cpu(tmp_path):
    """The tiny student distilled from the tiny2 teacher (same tokenizer, another shape): Tidal loads
    the teacher folder the setup built, the teacher's forward is a phase, TRL is not run."""
    record = tmp_path / "matrix.jsonl"
    out = _matrix(["--tiny", "--cases", "tiny-4x8-natural-distilltiny2", "--trl", "tiny-4x8-*", "--warmup", "0",
                   "--steps", "1", "--record", str(record), "--work-dir", str(tmp_path / "w"), "--commit", "abc"], tmp_path)
    assert out.returncode != 0 and "--trl (TRL runs only plain cases: no distillation" in out.stderr
    out = _matrix(["--tiny", "--cases", "tiny-4x8-natural-distilltiny2", "--warmup", "0", "--steps", "1",
                   "--record", str(record), "--work-dir", str(tmp_path / "w"), "--commit", "abc"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    (x,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert CASE_KEYS <= set(x), CASE_KEYS - set(x)
    assert x["case"] == "tiny-4x8-natural-distilltiny2" and x["teacher_size"] == "tiny2" and x["size"] == "tiny"
    assert x["error"] is None and x["checks_ok"] is True and x["checks"]["teacher_iff_distill"] is True, x
    assert x["phases"]["teacher_logprobs"] > 0 and {"generate", "train"} <= set(x["phases"])
    assert x["trl_iteration_s"] is None and x["bounds"] == {}  # no ceilings on CPU
    teacher = tmp_path / "w" / "teacher-tiny2"
    assert json.loads((teacher / "config.json").read_text())["hidden_size"] == SHAPES["tiny2"]["hidden_size"]
    assert (teacher / "tokenizer.json").read_text() == (tmp_path / "w" / "tokenizer-1024" / "tokenizer.json").read_text()


def test_heavy_tail_caps_about_a_tenth_and_names_its_cases():
    many = workloads.natural_lengths(40000, 8192, seed=3, rollout=0, tail="heavy")
    capped = sum(x == 8192 for x in many) / len(many)
    assert 0.09 < capped < 0.11 and 0.11 * 8192 < sorted(many)[len(many) // 2] < 0.14 * 8192
    w = workloads.Workload(size="1.5b", prompts=8, samples=16, prompt_len=256, max_new_tokens=8192, lengths="natural",
                           tail="heavy", rollout="carry")
    assert w.name == "1.5b-128x8192-natural-heavy-g16-carry"
    assert w.completion_lengths(1, seed=2) == workloads.natural_lengths(128, 8192, seed=2, rollout=1, tail="heavy")
    with pytest.raises(ValueError, match="tail"):
        workloads.Workload(size="0.5b", prompts=2, samples=8, prompt_len=8, max_new_tokens=64, tail="heavy")
    cases = workloads.long_tail_matrix()
    assert {w.tail for w in cases} == {"lognormal", "heavy"} and {w.samples for w in cases} == {8, 16}
    assert {w.rollout for w in cases} == {"plain", "carry", "drop"} and {w.size for w in cases} == {"0.5b", "1.5b", "7b"}
