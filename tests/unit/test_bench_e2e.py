"""bench/e2e_grpo.py: bounds with hand-computed values, case order, aggregation, the tokenizer it
builds, and (slow) a CPU smoke run of its Tidal path in --tiny mode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "e2e_grpo.py")


def _load():
    spec = importlib.util.spec_from_file_location("e2e_grpo_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


e2e = _load()


def _figures(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_param_count_matches_published_qwen2_sizes():
    assert e2e.param_count(e2e.SHAPES["0.5b"]) == 494_032_768
    assert e2e.param_count(e2e.SHAPES["1.5b"]) == 1_543_714_304


def test_param_count_matches_a_built_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=48, vocab_size=40)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    assert e2e.param_count(shape) == sum(p.numel() for p in model.parameters())


def test_kv_bytes_per_token_05b():
    # K and V x 24 layers x 2 KV heads x head_dim 64 x 2 bytes
    assert e2e.kv_bytes_per_token(e2e.SHAPES["0.5b"]) == 2 * 24 * 2 * 64 * 2 == 12288


def test_generation_bound_hand_computed():
    # prefill 2*100*1*3/1e4 = 0.06; step k=1: max((200 + 2*4*10)/1000, 400/1e4) = 0.28; k=2: (200+2*5*10)/1000 = 0.30
    got = e2e.generation_bound_s(n_params=100, kv_bytes=10, seqs=2, unique_prompts=1, prompt_len=3, new_tokens=3,
                                 copy_bw=1000.0, matmul_flops=1e4)
    assert got == pytest.approx(0.64)


def test_generation_bound_compute_bound_when_matmul_is_slow():
    # each decode step: read 280-300 B / 1e6 B/s = 0.3 ms < flops 2*100*2 / 100 = 4 s
    got = e2e.generation_bound_s(n_params=100, kv_bytes=10, seqs=2, unique_prompts=1, prompt_len=3, new_tokens=3,
                                 copy_bw=1e6, matmul_flops=100.0)
    assert got == pytest.approx(2 * 100 * 3 / 100 + 2 * 4.0)


def test_train_forward_and_sync_bounds_hand_computed():
    assert e2e.train_bound_s(n_params=100, tokens=10, matmul_flops=1e4, copy_bw=1000.0) == pytest.approx(0.6 + 2.8)
    assert e2e.forward_bound_s(n_params=100, tokens=10, matmul_flops=1e4) == pytest.approx(0.2)
    assert e2e.weight_sync_bound_s(n_params=100, copy_bw=1000.0) == pytest.approx(0.6)


def test_phase_bounds_reference_only_with_kl():
    s = e2e.BenchSettings()
    kw = dict(n_params=1000, shape=e2e.SHAPES["tiny"], s=s, copy_bw=1e9, matmul_flops=1e12)
    off, on = e2e.phase_bounds(kl=False, **kw), e2e.phase_bounds(kl=True, **kw)
    assert set(off) == {"generate", "actor_logprobs", "train", "weight_sync"}
    assert on["reference_logprobs"] == on["actor_logprobs"] == pytest.approx(2 * 1000 * 128 * 384 / 1e12)
    assert set(e2e.phase_bounds(kl=True, old_logprobs=False, **kw)) == {"generate", "reference_logprobs", "train", "weight_sync"}


def test_settings_reject_a_micro_batch_that_does_not_divide():
    with pytest.raises(ValueError, match="trl_micro_batch"):
        e2e.BenchSettings(trl_micro_batch=48)


def test_plan_cases_priority_order():
    cases = e2e.plan_cases(["tidal", "trl"], ["0.5b", "1.5b"], [False, True])
    assert [c.name for c in cases] == [
        "tidal-0.5b-kloff", "trl-0.5b-kloff",
        "tidal-0.5b-klon", "tidal-1.5b-kloff", "trl-0.5b-klon", "trl-1.5b-kloff",
        "tidal-1.5b-klon", "trl-1.5b-klon",
    ]


def test_bench_score_and_reward_adapters():
    assert e2e.bench_score([1, 2, 3]) == pytest.approx(6 / 997)
    assert e2e.bench_score([997, 5]) == pytest.approx(5 / 997)
    assert e2e.trl_reward(["p"], ["c"], completion_ids=[[1, 2, 3]]) == [pytest.approx(6 / 997)]

    class S:
        response_ids = [4]

    assert e2e.tidal_reward([S()]) == [pytest.approx(4 / 997)] and e2e.tidal_reward.batched is True


def _tidal_step(step, wall, gen_s, peak, n=4, length=8):
    return {"kind": "step", "step": step, "wall_s": wall, "peak_allocated": peak, "peak_reserved": peak + 1,
            "metrics": {"time/generate": gen_s, "time/train": 0.5, "response/length_mean": float(length),
                        "reward/mean": 0.3, "actor/skipped": 0.0},
            "generate": {"prompts": 2, "completions": n, "min_len": length, "max_len": length},
            "timeline": [{"label": f"s{step}", "allocated": 1, "reserved": 2}],
            "calls": [{"name": "update_engine_weights", "seconds": 0.1 * step, "returned": 64}]}


def test_summarize_tidal_medians_peaks_and_checks():
    s = e2e.BenchSettings(**e2e.TINY)  # warm-up 1, 2 timed steps; 2 prompts x 2 samples, 8 tokens
    records = [{"kind": "init", "init_s": 3.0, "prompt_lens": [8], "peak_allocated": 50, "peak_reserved": 60},
               _tidal_step(1, 9.0, 5.0, 10), _tidal_step(2, 1.0, 0.2, 70), _tidal_step(3, 2.0, 0.4, 20)]
    sm = e2e.summarize_tidal(records, s)
    assert sm["warmup_s"] == [9.0] and sm["steady_s"] == [1.0, 2.0]
    assert sm["phases"] == {"generate": pytest.approx(0.3), "train": pytest.approx(0.5)}
    assert sm["peak_allocated"] == 70 and sm["peak_reserved"] == 71
    assert sm["weight_sync"] == {"bytes": 64, "seconds": [pytest.approx(0.2), pytest.approx(0.3)]}
    assert sm["timeline_step"] == 3 and sm["timeline"][0]["label"] == "s3"
    assert all(sm["checks"].values()) and sm["error"] is None
    assert e2e.summarize_tidal(records, s, kl=True)["checks"]["reference_model_iff_kl"] is False  # no actor/kl metric


def test_engine_host_ms_per_engine_step():
    steps = [{"engine": {"decode_steps": 9, "prefill_steps": 1, "schedule_s": 0.002, "wait_s": 0.01, "preemptions": 0}},
             {"engine": {"decode_steps": 4, "prefill_steps": 1, "schedule_s": 0.002, "wait_s": 0.01}},
             {"engine": {"decode_steps": 3, "prefill_steps": 1, "schedule_s": 0.004, "wait_s": 0.0}}]
    # per engine step: schedule 0.2, 0.4, 1.0 ms; wait 1.0, 2.0, 0.0 ms; 10, 5, 4 engine steps
    assert e2e.engine_host_ms(steps) == {"schedule": pytest.approx(0.4), "wait": pytest.approx(1.0), "engine_steps": 5}
    assert e2e.engine_host_ms([{"engine": {}}, {}]) is None  # an engine without host timers


def test_summarize_tidal_flags_a_short_completion():
    s = e2e.BenchSettings(**e2e.TINY)
    records = [{"kind": "init", "prompt_lens": [8]}, _tidal_step(1, 1.0, 0.1, 1), _tidal_step(2, 1.0, 0.1, 1, length=7)]
    checks = e2e.summarize_tidal(records, s)["checks"]
    assert checks["completion_tokens_forced"] is False and checks["response_length_metric"] is False
    assert checks["prompt_len"] is True


def test_summarize_trl_generation_checks():
    s = e2e.BenchSettings(**e2e.TINY)
    gen = {"seconds": 0.5, "batch": 4, "prompt_len": 8, "new_tokens": 8}
    records = [{"kind": "step", "step": i, "wall_s": float(i), "generate_s": 0.5, "generate": [gen], "peak_allocated": None}
               for i in (1, 2, 3)]
    records += [{"kind": "log", "step": 1, "logs": {"completions/mean_length": 8.0, "completions/min_length": 8.0,
                                                    "completions/max_length": 8.0}},
                {"kind": "done", "peak_allocated": 123, "peak_reserved": 456}]
    sm = e2e.summarize_trl(records, s)
    assert sm["steady_s"] == [2.0, 3.0] and sm["phases"] == {"generate": 0.5}
    assert sm["peak_allocated"] == 123 and all(sm["checks"].values())


def test_tokenizer_folder_loads_as_wordlevel(tmp_path):
    from transformers import AutoTokenizer

    tok = e2e.build_tokenizer(16)
    assert tok("t3 t5 t0")["input_ids"] == [3, 5, 0]
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (14, 15, 16)
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("t3 t5 t0")["input_ids"] == [3, 5, 0]
    assert loaded.decode([3, 14], skip_special_tokens=True) == "t3"


def test_write_prompts_exact_length(tmp_path):
    path = tmp_path / "p.jsonl"
    e2e.write_prompts(str(path), rows=3, prompt_len=5, vocab_size=16)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3
    assert all(len(r["prompt"].split()) == 5 and all(0 <= int(w[1:]) < 14 for w in r["prompt"].split()) for r in rows)


def _run(args, tmp_path, timeout):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
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
    assert len(it["steady_s"]) == e2e.TINY["tidal_steps"] and it["median_s"] > 0
    phases = {f["phase"] for f in by["phase"]}
    assert {"engine_wake", "generate", "engine_sleep", "reward", "train", "weight_sync"} <= phases
    assert "actor_logprobs" not in phases  # one optimizer step per rollout: the update's forward gives them
    labels = [p[0] for p in by["memory_timeline"][0]["points"]]
    assert labels[0] == "iteration:start" and "sleep/engine:after" in labels and "update_engine_weights/engine:after" in labels
    assert by["weight_sync"][0]["bytes"] == 4 * e2e.param_count(e2e.SHAPES["tiny"])  # fp32 engine on CPU
    host = by["engine_host"][0]  # native engine host timers per step: one prefill (samples token 1) + 7 decodes
    assert host["engine_steps"] == e2e.TINY["new_tokens"] and host["wait"] >= 0 and host["submit"] > 0, host
    recorded = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(recorded) == len(figs) and all(r["run_id"] == recorded[0]["run_id"] and "commit" in r for r in recorded)
    assert (tmp_path / "o" / "raw.jsonl").exists() and (tmp_path / "o" / "logs.txt").exists()
    # --profile: one extra iteration after the timed ones, not in the medians nor the timeline
    prof = by["profile"][0]
    assert "error" not in prof, prof
    assert prof["step"] == e2e.TINY["tidal_warmup"] + e2e.TINY["tidal_steps"] + 1
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


def test_report_with_ceilings_bounds_ratio_and_record(tmp_path, capsys):
    """The GPU-only branches of the parent (bounds from ceilings, weight-sync bandwidth, ratio) on synthetic summaries."""
    args = e2e.parse_args(["--work-dir", str(tmp_path), "--record", str(tmp_path / "rec.jsonl"), "--commit", "abc"])
    s = e2e.BenchSettings()
    run = e2e.Run(args, s)
    shape = e2e.SHAPES["0.5b"]
    n = e2e.param_count(shape)
    run.models["0.5b"] = {"params": n, "shape": shape}
    run.ceilings = {"copy_bw": 4e12, "matmul_flops": 8e14}
    tidal = {"steady_s": [0.9, 1.0, 1.1], "warmup_s": [5.0], "init_s": 10.0, "stopped_early": False, "checks": {"a": True},
             "peak_allocated": 20 * 2**30, "peak_reserved": 30 * 2**30, "rc": 0, "error": None,
             "phases": {"generate": 0.4, "train": 0.3, "reward": 0.01},
             "weight_sync": {"bytes": 2 * n, "seconds": [0.01, 0.02, 0.03]},
             "timeline": [{"label": "train:end", "allocated": 2**30, "reserved": 2**31, "device_used": 5 * 2**30, "peak": 3 * 2**30}],
             "timeline_calls": [{"name": "sleep", "returned": 123}], "timeline_step": 7}
    trl = {**tidal, "steady_s": [9.0, 10.0, 11.0], "phases": {"generate": 6.0}, "peak_allocated": 40 * 2**30}
    run.results[e2e.Case(framework="tidal", size="0.5b", kl=False)] = tidal
    run.report_case(e2e.Case(framework="tidal", size="0.5b", kl=False), tidal, "")
    run.results[e2e.Case(framework="trl", size="0.5b", kl=False)] = trl
    run.report_case(e2e.Case(framework="trl", size="0.5b", kl=False), trl, "")
    run.finish(list(run.results))
    figs = _figures(capsys.readouterr().out)
    phase = {(f["framework"], f["phase"]): f for f in figs if f["figure"] == "phase"}
    tokens = 128 * 384
    assert phase[("tidal", "train")]["bound_s"] == pytest.approx(6 * n * tokens / 8e14 + 28 * n / 4e12, rel=1e-3)
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
    summary, text = e2e.analyze_profile(events, cuda=True)
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
    assert e2e._interval_union([(0, 2), (1, 3), (5, 6)]) == 4
