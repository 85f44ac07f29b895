"""bench/grpo, the Tidal-against-TRL side (``python bench/e2e_grpo.py`` = ``python -m bench.grpo e2e``):
shapes and bounds with hand-computed values, case order, the runners' summaries and checks, the
tokenizer it builds, the parent's figures on synthetic summaries, the profile analysis, and (slow)
a CPU smoke run of its Tidal path in --tiny mode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from bench.grpo import assets, bounds, e2e, profile, rewards, settings, shapes, tidal_runner, trl_runner
from bench.grpo.bounds import Ceilings
from bench.grpo.workloads import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "e2e_grpo.py")
# hidden 4, one layer, one head of 4, one KV head, intermediate 1, vocab 2, tied: every count by hand
SMALL = dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, intermediate_size=1,
             vocab_size=2, tie_word_embeddings=True)
C = Ceilings(copy_bw=1000.0, matmul_flops=1e4)
TINY_W = Workload(size="tiny", **e2e.TINY)


def _figures(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_param_count_matches_published_qwen25_sizes():
    expected = {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "3b": 3_085_938_688, "7b": 7_615_616_512}
    assert {z: shapes.param_count(shapes.SHAPES[z]) for z in expected} == expected
    # the 7B model unties its embeddings (vocab 152064), the smaller ones tie them
    assert [shapes.SHAPES[z]["tie_word_embeddings"] for z in expected] == [True, True, True, False]
    assert shapes.SHAPES["7b"]["vocab_size"] == 152064 and shapes.SHAPES["3b"]["vocab_size"] == 151936
    assert all(shapes.SHAPES[z]["max_position_embeddings"] == 32768 and shapes.SHAPES[z]["rope_theta"] == 1e6 for z in expected)


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_matches_a_built_model(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=48, vocab_size=40, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(Qwen2Config(**shape))
    assert shapes.param_count(shape) == sum(p.numel() for p in model.parameters())


def test_matmul_counts_hand_computed():
    # q 16 + k, v 2 x 16 + o 16 + mlp 3 x 4 = 76 per layer; LM head 2 x 4
    assert shapes.layer_matmul_params(SMALL) == 76 and shapes.head_params(SMALL) == 8
    assert shapes.matmul_params(SMALL) == 84
    assert shapes.param_count(SMALL) == 76 + 4 + 8 + 8 + 8 + 4  # + q/k/v biases, 2 norms, embedding, final norm
    assert shapes.kv_bytes_per_token(shapes.SHAPES["0.5b"]) == 2 * 24 * 2 * 64 * 2 == 12288


def test_generation_bound_hand_computed():
    # prefill of 1 prompt of 3: 2*76*3 + 2*8 (head on the last token) + attention 2*1*4*3*4 = 568 FLOPs -> 0.0568 s
    # lengths [3, 1]: steps k=1, 2 with one sequence running; k=1: read (2*84 + 1*4*16) / 1000 = 0.232 > flops
    # (2*84 + 4*4*4) / 1e4; k=2: (168 + 5*16) / 1000 = 0.248
    got = bounds.generation_bound_s(SMALL, prompt_len=3, unique_prompts=1, completion_lens=[3, 1], c=C)
    assert got == pytest.approx(0.0568 + 0.232 + 0.248)


def test_generation_bound_is_compute_bound_when_matmul_is_slow():
    slow = Ceilings(copy_bw=1e9, matmul_flops=100.0)
    got = bounds.generation_bound_s(SMALL, prompt_len=3, unique_prompts=1, completion_lens=[2, 2], c=slow)
    # prefill 568 FLOPs; the one decode step: 2*84*2 + 4*1*4*(2*4) = 464 FLOPs
    assert got == pytest.approx((568 + 464) / 100.0, rel=1e-6)


def test_forward_train_sync_bounds_and_mfu_hand_computed():
    # prompt 3, completions [3, 1]: body 2*76*(6+4) + head 2*8*(3+1) + attention 2*1*4*(6*7 + 4*5)
    assert bounds.forward_flops(SMALL, 3, [3, 1]) == 1520 + 64 + 496
    assert bounds.train_flops(SMALL, 3, [3, 1]) == 3 * 2080
    n = shapes.param_count(SMALL)
    b = bounds.phase_bounds(SMALL, prompt_len=3, unique_prompts=1, completion_lens=[3, 1], c=C, old_logprobs=True, kl=True)
    assert b["train"] == pytest.approx(6240 / 1e4 + 28 * n / 1000)
    assert b["actor_logprobs"] == b["reference_logprobs"] == pytest.approx(0.208)
    assert b["weight_sync"] == pytest.approx(6 * n / 1000)
    assert bounds.train_mfu(SMALL, prompt_len=3, completion_lens=[3, 1], seconds=2.0, c=C) == pytest.approx(0.312)
    assert bounds.train_mfu(SMALL, prompt_len=3, completion_lens=[3, 1], seconds=None, c=C) is None


def test_phase_bounds_reference_only_with_kl_and_actor_only_with_its_pass():
    kw = dict(prompt_len=3, unique_prompts=1, completion_lens=[2, 2], c=C)
    assert set(bounds.phase_bounds(SMALL, old_logprobs=True, kl=False, **kw)) == {"generate", "actor_logprobs", "train", "weight_sync"}
    assert set(bounds.phase_bounds(SMALL, old_logprobs=False, kl=True, **kw)) == {"generate", "reference_logprobs", "train", "weight_sync"}


def test_settings_validation_and_trl_micro_batch():
    with pytest.raises(ValueError, match="trl_dtype"):
        settings.RunSettings(trl_dtype="float16")
    with pytest.raises(ValueError, match="trl_micro_batch.*must divide"):
        settings.trl_micro_batch(settings.RunSettings(trl_micro_batch=48), 128, 384)
    auto = settings.RunSettings()
    assert settings.trl_micro_batch(auto, 128, 384) == 32  # 16384 // 384 = 42 -> largest divisor of 128 is 32
    assert settings.trl_micro_batch(auto, 512, 1280) == 8
    assert settings.trl_micro_batch(auto, 4, 100000) == 1


def test_plan_cases_priority_order():
    cases = e2e.plan_cases(["tidal", "trl"], ["0.5b", "1.5b"], [False, True])
    assert [c.name for c in cases] == [
        "tidal-0.5b-kloff", "trl-0.5b-kloff",
        "tidal-0.5b-klon", "tidal-1.5b-kloff", "trl-0.5b-klon", "trl-1.5b-kloff",
        "tidal-1.5b-klon", "trl-1.5b-klon",
    ]


def test_bench_score_and_reward_adapters():
    assert rewards.bench_score([1, 2, 3]) == pytest.approx(6 / 997)
    assert rewards.bench_score([997, 5]) == pytest.approx(5 / 997)
    assert rewards.trl_reward(["p"], ["c"], completion_ids=[[1, 2, 3]]) == [pytest.approx(6 / 997)]

    class S:
        response_ids = [4]

    assert rewards.tidal_reward([S()]) == [pytest.approx(4 / 997)] and rewards.tidal_reward.batched is True


def test_tidal_config_reward_path_resolves():
    from tidal.rewards.function import load_function

    assert load_function(tidal_runner.REWARD_PATH, "path") is rewards.tidal_reward


def _tidal_step(step, wall, gen_s, peak, lengths=(8, 8, 8, 8), expected=None, reason="length", kl=False):
    metrics = {"time/generate": gen_s, "time/train": 0.5, "response/length_mean": sum(lengths) / len(lengths),
               "reward/mean": 0.3, "actor/skipped": 0.0}
    if kl:
        metrics["actor/kl"] = 0.0
    return {"kind": "step", "step": step, "wall_s": wall, "peak_allocated": peak, "peak_reserved": peak + 1,
            "metrics": metrics, "rollouts": 1, "expected_lengths": list(expected or lengths),
            "rollout": {"prompts": 2, "lengths": list(lengths), "finish_reasons": [reason] * len(lengths)},
            "timeline": [{"label": f"s{step}", "allocated": 1, "reserved": 2}],
            "calls": [{"name": "update_engine_weights/engine", "seconds": 0.1 * step, "returned": 64}],
            "engine": {}}


TINY_S = settings.RunSettings(**e2e.TINY_SETTINGS)  # warm-up 1, 2 timed steps


def test_summarize_tidal_medians_peaks_and_checks():
    records = [{"kind": "init", "init_s": 3.0, "prompt_lens": [8], "peak_allocated": 50, "peak_reserved": 60},
               _tidal_step(1, 9.0, 5.0, 10), _tidal_step(2, 1.0, 0.2, 70), _tidal_step(3, 2.0, 0.4, 20)]
    sm = tidal_runner.summarize_tidal(records, TINY_W, TINY_S)
    assert sm["warmup_s"] == [9.0] and sm["steady_s"] == [1.0, 2.0] and sm["first_iteration_s"] == 9.0
    assert sm["phases"] == {"generate": pytest.approx(0.3), "train": pytest.approx(0.5)}
    assert sm["peak_allocated"] == 70 and sm["peak_reserved"] == 71
    assert sm["weight_sync"] == {"bytes": 64, "seconds": [pytest.approx(0.2), pytest.approx(0.3)]}
    assert sm["timeline_step"] == 3 and sm["timeline"][0]["label"] == "s3"
    assert sm["lengths_per_step"] == [[8] * 4, [8] * 4]
    assert all(sm["checks"].values()) and sm["error"] is None, sm["checks"]
    kl = Workload(size="tiny", kl=True, **e2e.TINY)
    assert tidal_runner.summarize_tidal(records, kl, TINY_S)["checks"]["reference_model_iff_kl"] is False  # no actor/kl


def test_summarize_tidal_checks_natural_lengths_and_stop():
    nat = Workload(size="tiny", lengths="natural", **e2e.TINY)
    good = [_tidal_step(i, 1.0, 0.1, 1, lengths=(3, 1, 8, 2), reason="stop") for i in (1, 2)]
    checks = tidal_runner.summarize_tidal([{"kind": "init", "prompt_lens": [8]}] + good, nat, TINY_S)["checks"]
    assert all(checks.values()) and "finish_stop" in checks, checks
    bad = [good[0], _tidal_step(2, 1.0, 0.1, 1, lengths=(3, 1, 8, 2), expected=(3, 1, 8, 3), reason="length")]
    checks = tidal_runner.summarize_tidal([{"kind": "init", "prompt_lens": [8]}] + bad, nat, TINY_S)["checks"]
    assert checks["completion_lengths"] is False and checks["finish_stop"] is False and checks["response_length_metric"] is False


def test_summarize_tidal_flags_a_short_completion():
    records = [{"kind": "init", "prompt_lens": [8]}, _tidal_step(1, 1.0, 0.1, 1), _tidal_step(2, 1.0, 0.1, 1, lengths=(8, 8, 8, 7),
                                                                                                expected=(8, 8, 8, 8))]
    checks = tidal_runner.summarize_tidal(records, TINY_W, TINY_S)["checks"]
    assert checks["completion_lengths"] is False and checks["response_length_metric"] is False
    assert checks["prompt_len"] is True


def test_engine_host_ms_per_engine_step():
    steps = [{"engine": {"decode_steps": 9, "prefill_steps": 1, "schedule_s": 0.002, "submit_s": 0.003, "wait_s": 0.01,
                         "preemptions": 0, "ahead_decode_steps": 9}},
             {"engine": {"decode_steps": 4, "prefill_steps": 1, "schedule_s": 0.002, "submit_s": 0.001, "wait_s": 0.01,
                         "ahead_decode_steps": 3}},
             {"engine": {"decode_steps": 3, "prefill_steps": 1, "schedule_s": 0.004, "submit_s": 0.0, "wait_s": 0.0,
                         "ahead_decode_steps": 0}}]
    # per engine step: schedule 0.2, 0.4, 1.0 ms; submit 0.3, 0.2, 0 ms; host 0.5, 0.6, 1.0 ms; wait 1.0, 2.0, 0.0 ms;
    # decode steps ahead: 1, 0.75, 0
    assert tidal_runner.engine_host_ms(steps) == {"schedule": pytest.approx(0.4), "submit": pytest.approx(0.2),
                                                  "host": pytest.approx(0.6), "wait": pytest.approx(1.0), "engine_steps": 5,
                                                  "decode_steps": 4, "ahead_frac": 0.75}
    assert tidal_runner.engine_host_ms([{"engine": {}}, {}]) is None  # an engine without host timers


def test_predicted_peak_comes_from_the_trainers_memory_plan():
    import types

    assert tidal_runner.predicted_peak_gib(types.SimpleNamespace()) is None
    plan = types.SimpleNamespace(predicted_peak_allocated_gib=41.5)
    assert tidal_runner.predicted_peak_gib(types.SimpleNamespace(memory=types.SimpleNamespace(plan=plan))) == 41.5


def _trl_records(lengths_per_step, *, logs_min_max, clipped):
    gens = [{"seconds": 0.5, "batch": 4, "prompt_len": 8, "lengths": list(x), "lengths_as_expected": True} for x in lengths_per_step]
    records = [{"kind": "step", "step": i + 1, "wall_s": float(i + 1), "generate_s": 0.5, "generate": [g], "peak_allocated": None}
               for i, g in enumerate(gens)]
    records += [{"kind": "log", "step": i + 1, "logs": {"completions/mean_length": 1.0, "completions/min_length": lo,
                                                        "completions/max_length": hi, "completions/clipped_ratio": clipped}}
                for i, (lo, hi) in enumerate(logs_min_max)]
    return records + [{"kind": "done", "peak_allocated": 123, "peak_reserved": 456}]


def test_summarize_trl_generation_checks():
    records = _trl_records([[8] * 4] * 3, logs_min_max=[(8.0, 8.0)] * 3, clipped=1.0)
    sm = trl_runner.summarize_trl(records, TINY_W, TINY_S)
    assert sm["steady_s"] == [2.0, 3.0] and sm["phases"] == {"generate": 0.5} and sm["first_iteration_s"] == 1.0
    assert sm["peak_allocated"] == 123 and all(sm["checks"].values()), sm["checks"]
    assert sm["lengths_per_step"] == [[8] * 4, [8] * 4]
    nat = Workload(size="tiny", lengths="natural", **e2e.TINY)
    records = _trl_records([[3, 1, 8, 2]] * 3, logs_min_max=[(1.0, 8.0)] * 3, clipped=0.0)
    assert all(trl_runner.summarize_trl(records, nat, TINY_S)["checks"].values())
    records = _trl_records([[3, 1, 8, 2]] * 3, logs_min_max=[(1.0, 8.0)] * 3, clipped=0.25)  # a row without EOS
    assert trl_runner.summarize_trl(records, nat, TINY_S)["checks"]["clipped_ratio"] is False


def test_trl_end_at_length_processor_and_eos_cut():
    import torch

    proc = trl_runner.end_at_length([1, 3], eos_ids=[4], prompt_width=2)
    scores = torch.zeros(2, 6)
    first = proc(torch.zeros(2, 2, dtype=torch.long), scores.clone())  # sampling completion token 1
    assert torch.isinf(first[0]).tolist() == [True, True, True, True, False, True]  # row 0 must end now: only EOS
    assert torch.isinf(first[1]).tolist() == [False] * 4 + [True, False]  # row 1 may not end yet
    third = proc(torch.zeros(2, 4, dtype=torch.long), scores.clone())  # token 3: row 1 ends
    assert torch.isinf(third[1]).tolist() == [True, True, True, True, False, True]
    assert trl_runner.cut_after_eos([[5, 4, 0, 0], [1, 2, 3]], {4}) == [[5, 4], [1, 2, 3]]


def test_tokenizer_folder_loads_as_wordlevel(tmp_path):
    from transformers import AutoTokenizer

    tok = assets.build_tokenizer(16)
    assert tok("t3 t5 t0")["input_ids"] == [3, 5, 0]
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (14, 15, 16)
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(assets.TOKENIZER_CONFIG))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("t3 t5 t0")["input_ids"] == [3, 5, 0]
    assert loaded.decode([3, 14], skip_special_tokens=True) == "t3"


def test_write_prompts_exact_length(tmp_path):
    path = tmp_path / "p.jsonl"
    assets.write_prompts(str(path), rows=3, prompt_len=5, vocab_size=16)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3
    assert all(len(r["prompt"].split()) == 5 and all(0 <= int(w[1:]) < 14 for w in r["prompt"].split()) for r in rows)


def _run(args, tmp_path, timeout):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, SCRIPT, *args, "--work-dir", str(tmp_path / "w")], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return _figures(out.stdout)


def test_time_budget_exhausted_still_prints_summary(tmp_path):
    figs = _run(["--tiny", "--only", "tidal", "--kl", "off", "--time-budget-s", "0.5"], tmp_path, 120)
    kinds = [f["figure"] for f in figs]
    assert kinds[-1] == "summary" and "error" in kinds and "iteration" not in kinds
    assert figs[-1]["cases_run"] == []


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None, reason="trl is installed here")
def test_missing_trl_is_a_json_error_line(tmp_path):
    figs = _run(["--tiny", "--only", "trl"], tmp_path, 120)
    assert figs[0]["figure"] == "error" and "prepare_wheels.sh" in figs[0]["message"]
    assert figs[-1]["figure"] == "summary" and figs[-1]["cases_planned"] == []


@pytest.mark.slow
def test_tiny_tidal_run_on_cpu(tmp_path):
    record = tmp_path / "results.jsonl"
    prof_dir = tmp_path / "prof"
    figs = _run(["--tiny", "--only", "tidal", "--kl", "off", "--record", str(record), "--out-dir", str(tmp_path / "o"),
                 "--profile", str(prof_dir)], tmp_path, 600)
    by = {}
    for f in figs:
        by.setdefault(f["figure"], []).append(f)
    it = by["iteration"][0]
    assert it["framework"] == "tidal" and it["checks_ok"] is True, it
    assert len(it["steady_s"]) == e2e.TINY_SETTINGS["tidal_steps"] and it["median_s"] > 0
    phases = {f["phase"] for f in by["phase"]}
    assert {"engine_wake", "generate", "engine_sleep", "reward", "train", "weight_sync"} <= phases
    assert "actor_logprobs" not in phases  # one optimizer step per rollout: the update's forward gives them
    labels = [p[0] for p in by["memory_timeline"][0]["points"]]
    assert labels[0] == "iteration:start" and "sleep/engine:after" in labels and "update_engine_weights/engine:after" in labels
    assert by["weight_sync"][0]["bytes"] == 4 * shapes.param_count(shapes.SHAPES["tiny"])  # fp32 engine on CPU
    host = by["engine_host"][0]  # native engine host timers per step: one prefill (samples token 1) + 7 decodes
    assert host["engine_steps"] == e2e.TINY["max_new_tokens"] and host["wait"] >= 0 and host["submit"] > 0, host
    assert host["host"] >= host["submit"]
    recorded = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(recorded) == len(figs) and all(r["run_id"] == recorded[0]["run_id"] and "commit" in r for r in recorded)
    assert {r["device"] for r in recorded} == {"cpu"}
    assert (tmp_path / "o" / "raw.jsonl").exists() and (tmp_path / "o" / "logs.txt").exists()
    # --profile: one extra iteration after the timed ones, not in the medians nor the timeline
    prof = by["profile"][0]
    assert "error" not in prof, prof
    assert prof["step"] == e2e.TINY_SETTINGS["tidal_warmup"] + e2e.TINY_SETTINGS["tidal_steps"] + 1
    assert by["memory_timeline"][0]["step"] == prof["step"] - 1
    assert {"iteration", "generate", "train", "weight_sync"} <= set(prof["phases"])
    assert all(p["wall_s"] > 0 and p["unprofiled_median_s"] > 0 for p in prof["phases"].values())
    assert sorted(os.listdir(prof_dir)) == sorted(prof["files"]) == ["phases.txt", "summary.json", "trace.json.gz"]
    summary = json.loads((prof_dir / "summary.json").read_text())
    train = summary["phases"]["train"]
    assert train["host_events"] > 0 and train["top_cpu_ops"] and "device_kernel_s" not in train  # CPU: no device figures
    assert summary["trace"]["kept"] is True
    text = (prof_dir / "phases.txt").read_text()
    assert "==== train:" in text and "top 25 by self CPU time" in text


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed here (bench/prepare_wheels.sh)")
def test_tiny_natural_lengths_are_the_same_in_both_frameworks(tmp_path):
    """Both frameworks on CPU with natural lengths: every rollout has the drawn lengths, EOS-terminated."""
    figs = _run(["--tiny", "--kl", "off", "--lengths", "natural", "--out-dir", str(tmp_path / "o")], tmp_path, 600)
    its = {f["framework"]: f for f in figs if f["figure"] == "iteration"}
    assert its["tidal"]["checks_ok"] and its["trl"]["checks_ok"], its
    assert its["tidal"]["checks"]["finish_stop"] and its["trl"]["checks"]["clipped_ratio"]
    raw = [json.loads(x) for x in (tmp_path / "o" / "raw.jsonl").read_text().splitlines()]
    tidal = [r["rollout"]["lengths"] for r in raw if r["case"].startswith("tidal") and r["kind"] == "step"]
    trl = [g["lengths"] for r in raw if r["case"].startswith("trl") and r["kind"] == "step" for g in r["generate"]]
    n = min(len(tidal), len(trl))
    assert n >= 2 and tidal[:n] == trl[:n]


def _synthetic(n, steady, phases, peak_gib, lengths):
    return {"steady_s": steady, "warmup_s": [5.0], "init_s": 10.0, "stopped_early": False, "checks": {"a": True},
            "peak_allocated": peak_gib * 2**30, "peak_reserved": 30 * 2**30, "rc": 0, "error": None, "phases": phases,
            "lengths_per_step": [lengths] * len(steady), "first_iteration_s": 5.0,
            "weight_sync": {"bytes": 2 * n, "seconds": [0.01, 0.02, 0.03]},
            "timeline": [{"label": "train:end", "allocated": 2**30, "reserved": 2**31, "device_used": 5 * 2**30, "peak": 3 * 2**30}],
            "timeline_calls": [{"name": "sleep", "returned": 123}], "timeline_step": 7}


def test_report_with_ceilings_bounds_ratio_and_record(tmp_path, capsys):
    """The GPU-only branches of the parent (bounds from ceilings, weight-sync bandwidth, ratio) on synthetic summaries."""
    args = e2e.parse_args(["--work-dir", str(tmp_path), "--record", str(tmp_path / "rec.jsonl"), "--commit", "abc"])
    args.device = "cpu"
    run = e2e.E2E(args, settings.RunSettings())
    shape = shapes.SHAPES["0.5b"]
    n = shapes.param_count(shape)
    run.session.models["0.5b"] = {"params": n, "shape": shape}
    run.session.ceilings = Ceilings(copy_bw=4e12, matmul_flops=8e14)
    tidal_case, trl_case = e2e.Case(framework="tidal", size="0.5b", kl=False), e2e.Case(framework="trl", size="0.5b", kl=False)
    tidal = _synthetic(n, [0.9, 1.0, 1.1], {"generate": 0.4, "train": 0.3, "reward": 0.01}, 20, [256] * 128)
    trl = {**_synthetic(n, [9.0, 10.0, 11.0], {"generate": 6.0}, 40, [256] * 128)}
    for case, sm in ((tidal_case, tidal), (trl_case, trl)):
        run.workloads[case] = run.workload(case)
        run.results[case] = sm
        run.report_case(case, sm, "")
    run.finish(list(run.results))
    figs = _figures(capsys.readouterr().out)
    phase = {(f["framework"], f["phase"]): f for f in figs if f["figure"] == "phase"}
    expected_train = bounds.train_flops(shape, 128, [256] * 128) / 8e14 + 28 * n / 4e12
    assert phase[("tidal", "train")]["bound_s"] == pytest.approx(expected_train, rel=1e-3)
    assert phase[("tidal", "reward")]["bound_s"] is None
    assert phase[("trl", "generate")]["bound_s"] == phase[("tidal", "generate")]["bound_s"] > 0
    ws = next(f for f in figs if f["figure"] == "weight_sync")
    assert ws["median_s"] == 0.02 and ws["GBps"] == pytest.approx(2 * n / 0.02 / 1e9, rel=1e-3)
    assert ws["bound_s"] == pytest.approx(6 * n / 4e12, rel=1e-3)
    ratio = next(f for f in figs if f["figure"] == "ratio")
    assert ratio["trl_over_tidal"] == 10.0 and ratio["memory_trl_over_tidal"] == 2.0
    summary = figs[-1]
    assert summary["target_tidal_le_1s"] is True and summary["target_ratio_ge_8"] is True
    timeline = next(f for f in figs if f["figure"] == "memory_timeline")
    assert timeline["points"] == [["train:end", 1.0, 2.0, 5.0, 3.0]] and timeline["returned_bytes"] == {"sleep": 123}
    recorded = [json.loads(line) for line in (tmp_path / "rec.jsonl").read_text().splitlines()]
    assert len(recorded) == len(figs) and {r["commit"] for r in recorded} == {"abc"}


def test_analyze_profile_assigns_kernels_by_launch_and_counts_syncs():
    """The CUDA branch of the --profile analysis on hand-made profiler events: a kernel launched in
    ``train`` but running past its range stays in ``train``; one with no runtime call goes by its start."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    cuda = DeviceType.CUDA

    def ev(id_, name, a, b, device_type=DeviceType.CPU, thread=1):
        return FunctionEvent(id=id_, name=name, thread=thread, start_us=a, end_us=b, device_type=device_type,
                             use_device="cuda", stack=[], input_shapes=[])

    events = EventList([
        ev(1, "iteration", 0, 100), ev(2, "phase/train", 10, 60), ev(3, "phase/weight_sync", 60, 90),
        ev(4, "phase/train", 10, 60, device_type=cuda),  # the GPU copy of an annotation: not a kernel
        ev(5, "aten::mm", 12, 20), ev(1001, "cudaLaunchKernel", 13, 14),
        ev(1001, "gemm_kernel", 40, 59, device_type=cuda),
        ev(6, "aten::item", 20, 50), ev(1002, "cudaMemcpyAsync", 21, 22), ev(1003, "cudaStreamSynchronize", 22, 49),
        ev(1002, "Memcpy DtoH (Device -> Pageable)", 45, 47, device_type=cuda),
        ev(7, "aten::add_", 30, 32, thread=2), ev(1004, "cuLaunchKernel", 30, 31, thread=2),
        ev(1004, "add_kernel", 55, 65, device_type=cuda),  # launched in train, ends after it
        ev(9999, "copy_kernel", 70, 80, device_type=cuda),  # no runtime call: by its start, weight_sync
    ], use_device="cuda")
    events._build_tree()
    summary, text = profile.analyze_profile(events, cuda=True)
    assert summary["device_events"] == 4 and summary["kernels_matched_by"] == {"launch": 3, "time": 1}
    train, sync, it = (summary["phases"][k] for k in ("train", "weight_sync", "iteration"))
    assert train["wall_s"] == pytest.approx(50e-6) and train["entries"] == 1
    assert train["device_kernels"] == 2 and train["device_kernel_s"] == pytest.approx(29e-6)
    assert train["device_copy_s"] == pytest.approx(2e-6) and train["memcpy_dtoh"] == 1
    assert train["device_busy_s"] == pytest.approx(25e-6)  # union of [40, 65]
    assert train["device_idle_frac"] == pytest.approx(0.5)
    assert train["kernel_launches"] == 2 and train["graph_launches"] == 0
    assert train["host_syncs"] == 1 and train["sync_calls"] == {"cudaStreamSynchronize": 1}
    assert train["top_kernels"][0] == ["gemm_kernel", 1, pytest.approx(19e-6)]
    assert sync["device_kernels"] == 1 and sync["top_kernels"][0][0] == "copy_kernel"
    assert it["device_kernels"] == 3 and it["range_self_cpu_s"] == pytest.approx(20e-6)  # 100 - 50 - 30
    assert "==== train:" in text and "top 25 by self device time" in text and "gemm_kernel" in text
    assert profile._interval_union([(0, 2), (1, 3), (5, 6)]) == 4
