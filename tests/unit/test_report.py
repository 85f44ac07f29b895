"""tidal.report on a fake run directory: PNG and self-contained HTML, grouping, resumed-file dedupe."""

import base64
import json
import re

from tidal.report import constant_keys, load_series, main, panels, unit_of


def fake_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for step in range(1, 31):
        rec = {
            "step": step,
            "reward/mean": step / 30,
            "kl/mean": 0.01 * step,
            "entropy": 1.0 - step / 60,
            "response/length_mean": 100.0 + step,
            "time/generate": 1.5,
            "time/update": 0.5,
            "memory/gpu_allocated_gib": 10.0,
            "loss": None if step == 7 else 0.3,
        }
        if step % 10 == 0:
            rec["eval/accuracy"] = step / 100
        lines.append(json.dumps(rec))
    lines.insert(20, json.dumps({"step": 5, "reward/mean": 99.0}))  # a resumed run re-logged step 5: last wins
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_load_series_dedupes_and_skips_nulls(tmp_path):
    series = load_series(fake_run(tmp_path) / "metrics.jsonl")
    steps, values = series["reward/mean"]
    assert steps == list(range(1, 31)) and values[4] == 99.0
    assert 5 not in series["kl/mean"][0]  # step 5 was replaced by a record without kl
    assert series["loss"][0] == [s for s in range(1, 31) if s not in (5, 7)]
    assert series["eval/accuracy"] == ([10, 20, 30], [0.1, 0.2, 0.3])


def test_panels_group_by_prefix_in_order():
    keys = ["time/a", "other_key", "reward/mean", "eval/acc", "kl/x"] + [f"zz/k{i}" for i in range(10)]
    titles = [t for t, _ in panels(keys)]
    assert titles == ["reward", "eval", "kl", "time", "other_key", "zz (1/2)", "zz (2/2)"]
    assert dict(panels(keys))["zz (2/2)"] == ["zz/k8", "zz/k9"]


def test_panels_never_mix_units():
    keys = ["eval/greedy_accuracy", "eval/pass@4", "eval/prompts_count", "reward/total", "reward/total/count",
            "reward/dropped_count", "time/generate", "memory/peak_allocated_gib"]
    assert [unit_of(k) for k in keys] == ["fraction", "fraction", "count", "", "count", "count", "s", "GiB"]
    assert panels(keys) == [("reward [value]", ["reward/total"]), ("reward [count]", ["reward/dropped_count", "reward/total/count"]),
                            ("eval [count]", ["eval/prompts_count"]), ("eval [fraction]", ["eval/greedy_accuracy", "eval/pass@4"]),
                            ("time", ["time/generate"]), ("memory", ["memory/peak_allocated_gib"])]


def test_constant_series_are_listed_not_plotted(tmp_path):
    run = fake_run(tmp_path)
    series = load_series(run / "metrics.jsonl")
    assert constant_keys(series) == ["loss", "memory/gpu_allocated_gib", "time/generate", "time/update"]
    assert main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "Constant (not plotted)" in page and "<tr><td>time/update</td><td>0.5</td></tr>" in page


def test_main_writes_png_and_self_contained_html(tmp_path, capsys):
    run = fake_run(tmp_path)
    assert main([str(run)]) == 0
    png = (run / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    page = (run / "report.html").read_text()
    embedded = re.search(r"src='data:image/png;base64,([^']+)'", page).group(1)
    assert base64.b64decode(embedded) == png
    assert not re.search(r"(src|href)=['\"](?!data:)", page)  # nothing external
    assert "<td>eval/accuracy</td><td>0.3</td><td>30</td>" in page
    assert "<td>reward/mean</td><td>1</td><td>30</td>" in page


def test_main_errors(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "note": "x"}\n')
    assert main([str(tmp_path)]) == 1
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    assert main([str(tmp_path)]) == 1
    assert "metrics.jsonl:1: not a metrics record" in capsys.readouterr().err
