"""tidal.report on a fake run directory: PNG and self-contained HTML, grouping, resumed-file dedupe."""

import base64
import json
import re

import pytest

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
    assert "<td>eval/accuracy</td><td>0.1</td><td>10</td><td>0.3</td><td>30</td>" in page  # start and end
    assert "<td>reward/mean</td><td>0.0333333</td><td>1</td><td>1</td><td>30</td>" in page


def test_one_unit_and_one_scale_per_axis():
    """MFU is not drawn with TFLOP/s, a length not with a reward, a gradient norm not with losses near 0."""
    assert [unit_of(k) for k in ("perf/mfu", "perf/train_tflops", "eval/greedy_length", "eval/greedy_reward",
                                 "actor/grad_norm", "actor/lr")] == ["fraction", "TFLOP/s", "tokens", "", "norm", "lr"]
    keys = ["perf/mfu", "perf/train_tflops", "eval/greedy_length", "eval/greedy_reward", "actor/grad_norm", "actor/lr",
            "actor/pg_loss", "actor/entropy", "actor/kl"]
    scales = {"actor/pg_loss": 0.02, "actor/entropy": 0.5, "actor/kl": 0.0004, "eval/greedy_reward": 0.6}
    got = dict(panels(keys, scales))
    assert got["perf [fraction]"] == ["perf/mfu"] and got["perf [TFLOP/s]"] == ["perf/train_tflops"]
    assert got["eval [tokens]"] == ["eval/greedy_length"] and got["eval [value]"] == ["eval/greedy_reward"]
    assert got["actor [norm]"] == ["actor/grad_norm"] and got["actor [lr]"] == ["actor/lr"]
    # without a unit: by magnitude, at most SCALE_RATIO apart (0.0004 | 0.02, 0.5)
    assert got["actor [value] (~1e-03)"] == ["actor/kl"] and got["actor [value] (~1e+00)"] == ["actor/entropy", "actor/pg_loss"]


def test_identical_series_both_show(tmp_path):
    import matplotlib.pyplot as plt

    from tidal.report import build_figure, identical_keys

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 4, "reward/total": s / 4,
                                                           "reward/math/mean": 1 - s / 4}) + "\n" for s in range(1, 5)))
    series = load_series(run / "metrics.jsonl")
    assert identical_keys(series) == {"reward/total": "reward/mean"}
    fig = build_figure(series, "t")
    lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    drawn, over = lines["reward/mean"], lines["reward/total (= reward/mean)"]
    assert over.get_linestyle() == "--" and over.get_linewidth() > drawn.get_linewidth()
    plt.close(fig)
    assert main([str(run)]) == 0
    assert "<td>reward/total (= reward/mean)</td>" in (run / "report.html").read_text()


def test_a_flat_reward_is_drawn_and_never_called_equal_to_another_flat_series(tmp_path):
    """Issue 44 item 15: report.png dropped a constant reward curve, and the HTML labelled it
    `reward/mean (= actor/approx_kl)` (both 0 all run: equal by accident, not the same data)."""
    import matplotlib.pyplot as plt

    from tidal.report import build_figure, identical_keys

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.0, "actor/approx_kl": 0.0, "loss": 1 / s,
                                                           "time/update": 0.5}) + "\n" for s in range(1, 5)))
    series = load_series(run / "metrics.jsonl")
    assert identical_keys(series) == {}
    fig = build_figure(series, "t")
    lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    assert lines["reward/mean"].get_linestyle() == "--" and list(lines["reward/mean"].get_ydata()) == [0.0] * 4
    assert "actor/approx_kl" not in lines  # a flat series of no headline group is listed, not drawn
    plt.close(fig)
    assert main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "(= " not in page and "<td>reward/mean</td>" in page
    assert "<tr><td>actor/approx_kl</td><td>0</td></tr>" in page and "<tr><td>reward/mean</td><td>0</td></tr>" not in page


def test_html_leads_with_reward_and_eval_and_shows_the_config(tmp_path):
    run = fake_run(tmp_path)
    (run / "config.yaml").write_text("run:\n  steps: 30\nmodel:\n  path: <m>\n")
    assert main([str(run)]) == 0
    page = (run / "report.html").read_text()
    head = page.split("<ul>", 1)[1].split("</ul>", 1)[0]
    assert head == ("<li><b>reward/mean</b>: 0.03333 at the start, 1 at the end</li>"
                    "<li><b>eval/accuracy</b>: 0.1 at the start, 0.3 at the end</li>")
    assert page.index("<ul>") < page.index("<img")
    assert "<h2>Resolved config</h2><pre>run:\n  steps: 30\nmodel:\n  path: &lt;m&gt;\n</pre>" in page


def test_main_errors(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "note": "x"}\n')
    assert main([str(tmp_path)]) == 1
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    assert main([str(tmp_path)]) == 1
    assert "metrics.jsonl:1: not a metrics record" in capsys.readouterr().err


# ---- phase-time bar, memory timeline, layout (issue 23 item 7) --------------------------------------

from tidal.report import BAR_STEPS, build_figure, layout, memory_keys, phase_keys  # noqa: E402

PHASES = {"generate": 1.5, "train": 0.5, "reward": 0.1}


def phase_run(tmp_path, steps=6):
    run = tmp_path / "prun"
    run.mkdir()
    lines = [json.dumps({"step": 0, "time/eval": 3.0, "eval/greedy_accuracy": 0.4})]  # the start evaluation
    for step in range(1, steps + 1):
        rec = {"step": step, "reward/mean": step / steps, "time/compile": 9.0 if step == 1 else 0.0,
               "memory/peak_allocated_gib": 10.0 + step, "memory/engine_kv_cache_gib": 40.0,
               "memory/device_used_gib": 60.0 + step / 2, "memory/engines_count": 1.0 + step}
        rec.update({f"time/{k}": v * step for k, v in PHASES.items()})
        rec["time/step"] = sum(v for k, v in rec.items() if k.startswith("time/") and k != "time/compile")
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_phase_and_memory_keys(tmp_path):
    series = load_series(phase_run(tmp_path) / "metrics.jsonl")
    # largest mean first; the step total and compile time are not stacked
    assert phase_keys(series) == ["time/generate", "time/eval", "time/train", "time/reward"]
    assert memory_keys(series) == ["memory/device_used_gib", "memory/engine_kv_cache_gib", "memory/peak_allocated_gib"]
    kinds = [(kind, title) for kind, title, _ in layout(series)]
    assert kinds[:4] == [("lines", "reward"), ("lines", "eval"), ("phases", "phase time per step [s]"),
                         ("memory", "memory timeline [GiB]")]  # what the run is for first
    flat = [k for _, _, keys in layout(series)[4:] for k in keys]
    assert "time/step" not in flat and "time/generate" not in flat and "memory/peak_allocated_gib" not in flat
    assert "time/compile" in flat and "memory/engines_count" in flat  # not GiB: a count panel of its own


def _axis(fig, title):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_phase_bar_stacks_each_step(tmp_path):
    import matplotlib.pyplot as plt

    fig = build_figure(load_series(phase_run(tmp_path) / "metrics.jsonl"), "t")
    ax = _axis(fig, "phase time per step [s]")
    tops: dict[float, float] = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2, 6)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert tops == pytest.approx({0.0: 3.0, **{float(s): sum(PHASES.values()) * s for s in range(1, 7)}})
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["step (sum)", "generate", "eval", "train", "reward"]
    plt.close(fig)


def test_phase_stack_as_areas_for_long_runs(tmp_path):
    import matplotlib.pyplot as plt

    fig = build_figure(load_series(phase_run(tmp_path, steps=BAR_STEPS + 5) / "metrics.jsonl"), "t")
    ax = _axis(fig, "phase time per step [s]")
    assert not ax.patches and len(ax.collections) == 4  # one filled area per phase, no 800 bars
    plt.close(fig)


def test_memory_timeline_one_panel_in_gib(tmp_path):
    import matplotlib.pyplot as plt

    fig = build_figure(load_series(phase_run(tmp_path) / "metrics.jsonl"), "t")
    ax = _axis(fig, "memory timeline [GiB]")
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"device_used_gib", "engine_kv_cache_gib", "peak_allocated_gib"}
    assert lines["engine_kv_cache_gib"].get_linestyle() == "--" and lines["peak_allocated_gib"].get_linestyle() == "-"
    assert list(lines["peak_allocated_gib"].get_ydata()) == [11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    assert ax.get_ylabel() == "GiB"
    plt.close(fig)


def test_titles_distinct_and_not_overlapping(tmp_path):
    """Every panel title is distinct, and no title's box overlaps another title or another panel
    (its ticks, labels and legend included) once drawn."""
    import matplotlib.pyplot as plt

    run = fake_run(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:  # many groups with long names: a crowded figure
        for i in range(12):
            f.write(json.dumps({"step": 31 + i, **{f"group_with_a_long_name_{g}/value_count": float(i * g) for g in range(9)},
                                "memory/peak_allocated_gib": float(i)}) + "\n")
    fig = build_figure(load_series(run / "metrics.jsonl"), "Tidal run with a long name")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title() for ax in shown]
    assert len(titles) == len(set(titles)) >= 12
    boxes = [ax.title.get_window_extent(renderer) for ax in shown] + [fig._suptitle.get_window_extent(renderer)]
    for i, a in enumerate(boxes):
        assert all(not a.overlaps(b) for b in boxes[i + 1:]), titles
    for ax, box in zip(shown, boxes):
        for other in shown:
            if other is not ax:
                assert not box.overlaps(other.get_tightbbox(renderer)), (ax.get_title(), other.get_title())
    plt.close(fig)


def test_html_names_the_panels(tmp_path):
    run = phase_run(tmp_path)
    assert main([str(run)]) == 0
    alt = re.search(r"<img alt='([^']+)'", (run / "report.html").read_text()).group(1)
    assert alt.startswith("metric curves: reward; eval; phase time per step [s]; memory timeline [GiB]")


@pytest.mark.slow
def test_report_html_renders_in_headless_chromium(tmp_path):
    """report.html opens in a real browser: no console error, no failed request, the image decodes."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    run = phase_run(tmp_path)
    assert main([str(run)]) == 0
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch()
        except sync_api.Error as e:
            if "Executable doesn't exist" not in str(e):
                raise
            pytest.skip(f"Playwright's headless Chromium is not installed ({str(e).splitlines()[0]}); "
                        "`playwright install chromium`")
        try:
            page = browser.new_page()
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"failed request {r.url}"))
            page.goto((run / "report.html").as_uri())
            page.wait_for_load_state("load")
            size = page.evaluate("() => { const i = document.querySelector('img'); return [i.complete, i.naturalWidth, i.naturalHeight]; }")
            assert size[0] and size[1] > 500 and size[2] > 300, size
            assert page.title().startswith("Tidal run") and "Constant (not plotted)" in page.content()
        finally:
            browser.close()
    assert errors == []
