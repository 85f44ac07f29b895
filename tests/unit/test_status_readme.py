"""README.md's Status figures are those `python -m bench.status` renders from bench/results (issue 23
item 10), and the renderer picks the newest run per case, skips errors and names commit and case."""

import json

import pytest

from bench import status


def test_readme_status_figures_are_current():
    assert status.readme_block(status.README.read_text()) == status.render(), (
        "README.md Status figures are stale: run `python -m bench.status`"
    )


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _summary(time, commit, median, *, trl=None, error=False, tidal_set=()):
    cases = {"tidal-0.5b-kloff": {"median_s": None if error else median, "n": 5, "peak_gib": 30.0,
                                  "checks_ok": True, "error": error}}
    if trl:
        cases["trl-0.5b-kloff"] = {"median_s": trl, "n": 3, "peak_gib": 20.0, "checks_ok": True, "error": False}
    return {"time": time, "commit": commit, "device": "GPU X", "settings": {"tidal_set": list(tidal_set)},
            "figure": "summary", "cases": cases, "tidal_main_s": None if error else median, "trl_main_s": trl,
            "target_tidal_le_1s": None if error else median <= 1, "target_ratio_ge_8": (trl / median >= 8) if trl else None}


def test_newest_run_per_case_errors_skipped(tmp_path):
    _write(tmp_path / "e2e_grpo.jsonl", [
        _summary("2026-01-02T00:00:00", "bbbbbbb", 1.5, trl=9.0),
        _summary("2026-01-01T00:00:00", "aaaaaaa", 2.0, trl=8.0),   # older, later in the file
        _summary("2026-01-03T00:00:00", "ccccccc", 0.5, error=True),  # failed case: not a figure
        _summary("2026-01-04T00:00:00", "ddddddd", 0.7, tidal_set=["train.x=1"]),
        {"time": "2026-01-05T00:00:00", "figure": "error", "commit": "eeeeeee", "error": "boom"},
    ])
    table = status.render(tmp_path)
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [r[1] for r in rows if r[0] == "| GRPO iteration, e2e"] == [
        "`tidal-0.5b-kloff`", "`trl-0.5b-kloff`", "`tidal-0.5b-kloff` with `train.x=1`"]
    plain = next(r for r in rows if r[1] == "`tidal-0.5b-kloff`")
    assert plain[2].startswith("1.5 s per iteration") and plain[3] == "bbbbbbb" and plain[4] == "GPU X |"
    assert "6.0x Tidal's 1.5 s in the same run" in table
    targets = [r for r in rows if r[0].startswith("| speed target")]
    assert [r[2] for r in targets] == ["not met: Tidal 1.5 s, TRL 9 s (6.0x)"] * 2  # the run with overrides does not count
    assert "eeeeeee" not in table and "ccccccc" not in table


def test_matrix_memory_multiturn_rollout_rows(tmp_path):
    case = {"figure": "case", "case": "0.5b-8x16-natural-carry", "prompt_len": 4, "kl": False, "iteration_s": 2.0,
            "phases": {"generate": 1.0, "train": 0.5}, "bounds": {"generate": 0.25, "train": 0.125},
            "generated_tokens_per_s": 12345.0, "peak_allocated_gib": 10.0, "trl_iteration_s": None,
            "commit": "1234567", "device": "GPU X", "time": "2026-01-01T00:00:00", "error": None}
    _write(tmp_path / "matrix.jsonl", [case, {**case, "error": "OOM", "commit": "7654321", "time": "2026-01-02T00:00:00"}])
    _write(tmp_path / "memory_check.jsonl", [{"figure": "memory_plan", "kind": "summary", "size": "1.5b", "lora": 0,
                                               "sequences": 8, "prompt_len": 4, "new_tokens": 16, "set": [],
                                               "predicted_peak_gib": 12.34, "measured_peak_gib": 11.0, "ratio": 0.89,
                                               "commit": "1234567", "device": "GPU X"}])
    _write(tmp_path / "multiturn.jsonl", [{"figure": "case", "case": "t4", "turns": 4, "tool_latency_ms": 50.0,
                                            "iteration_s": 1.3, "gpu_idle_frac": 0.24, "vs_single_turn": 1.5,
                                            "error": None, "commit": "1234567", "device": "GPU X"}])
    _write(tmp_path / "rollout.jsonl", [{"case": "main", "engine": "native", "variant": "graphs", "seqs": 8,
                                          "prompt_len": 4, "new_tokens": 16, "gen_tokens_per_s": 5000.0,
                                          "roofline_fraction": 0.2, "commit": "1234567", "device": "GPU X"},
                                         {"check": "greedy", "all_equal": True}])
    table = status.render(tmp_path)
    assert ("| GRPO iteration, matrix | `0.5b-8x16-natural-carry` (prompt 4) | 2 s per iteration; generate 1 s "
            "(bound 0.25), train 0.5 s (bound 0.125); 12,345 generated tok/s; peak 10 GiB | 1234567 | GPU X |") in table
    assert "7654321" not in table
    assert "predicted peak 12.3 GiB, measured 11.0 GiB (ratio 0.89)" in table
    assert "GPU idle 0.24 of generate, 1.50x the single-turn iteration" in table
    assert "native (graphs): 5,000 generated tok/s, 20% of the bandwidth roofline" in table
    assert len(table.splitlines()) == 2 + 4


def test_check_mode_and_bad_line(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{status.START}\n| stale |\n{status.END}\ny\n")
    monkeypatch.setattr(status, "README", readme)
    monkeypatch.setattr(status, "ROOT", tmp_path)
    assert status.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert status.main([]) == 0 and status.main(["--check"]) == 0
    assert readme.read_text().startswith("x\n") and readme.read_text().endswith(f"{status.END}\ny\n")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        status.read_jsonl(tmp_path / "bad.jsonl")
