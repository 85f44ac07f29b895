"""``tidal report RUN_DIR``: metric curves of a run as ``report.png`` and a self-contained ``report.html``.

Reads ``RUN_DIR/metrics.jsonl`` (as written by the ``jsonl`` logging backend). When a step appears
more than once (a file appended to by a resumed run), its last record wins.

What the run is for comes first: the **reward** and **eval** panels (the trained reward, the eval
accuracy), then two panels:

- **phase time per step**: a stacked bar per step of each ``time/<phase>`` in seconds
  (:func:`phase_keys`: every ``time/*`` but ``time/step``, their sum, drawn as a line over the bars,
  and ``time/compile``, already inside the phases that compiled), largest phase at the bottom;
- **memory timeline**: every ``memory/*_gib`` series per step, in GiB, in one panel (a constant one,
  such as the engine's KV cache, dashed: the level the others are read against).

The other keys are grouped by their prefix before the first ``/`` (a key without one is its own
group) and by their unit (:func:`unit_of`: seconds, GiB, counts, fractions, tokens, TFLOP/s, norms,
learning rates, other values), so one axis never mixes a count of 200 with accuracies near 1, MFU
with TFLOP/s or a length with a reward; values without a unit are split further by scale
(:data:`SCALE_RATIO`: a gradient norm near 10 is not drawn on the axis of a loss near 0.01). Each
group is one panel (split into several when it has more than ``MAX_LINES`` keys). A series that
never changes gets no curve of its own (the HTML lists it with its value), unless it is a reward or
eval series: a reward flat at 0 is what the report is for (drawn dashed). A changing series equal to
another at every step is drawn dashed over it and labelled ``(= other)`` (:func:`identical_keys`),
so neither hides the other. Groups are ordered reward, eval, kl, entropy, response/length, loss,
time, memory, then the rest alphabetically. Non-numeric and null values are skipped. Panel titles
are distinct and laid out without overlap (constrained layout). The HTML page leads with the
reward and eval accuracy at the start and the end, embeds the PNG (base64, its ``alt`` naming the
panels), tables each key's start and end values, and shows the run's resolved config
(``RUN_DIR/config.yaml``); it references no external file.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
import sys
from pathlib import Path

MAX_LINES = 8
NOT_STACKED = ("time/step", "time/compile")  # the phases' sum; compile time is inside the phases that compiled
BAR_STEPS = 200  # above this many steps the phase stack is drawn as areas, not one bar per step
GROUP_ORDER = ["reward", "eval", "kl", "entropy", "response", "length", "loss", "time", "memory", "gpu"]
HEADLINE = ("reward", "eval")  # the groups drawn first
SCALE_RATIO = 30.0  # values without a unit share an axis only within this ratio of magnitudes

Series = dict[str, tuple[list[int], list[float]]]


def load_series(path: Path) -> Series:
    """``{key: (steps, values)}`` from a metrics.jsonl, the last record of a step winning."""
    from tidal.files import open_regular

    by_step: dict[int, dict] = {}
    with open_regular(path, "r", what="metrics file", encoding="utf-8") as lines:
        records = [(line_no, line) for line_no, line in enumerate(lines, start=1) if line.strip()]
    for line_no, line in records:
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line_no}: not a metrics record ({e})") from None
    series: Series = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(float(value))
    return series


def _group_rank(group: str) -> tuple[int, str]:
    for i, word in enumerate(GROUP_ORDER):
        if word in group.lower():
            return i, group
    return len(GROUP_ORDER), group


def unit_of(key: str) -> str:
    """The unit a metric is plotted in, from its name (:mod:`tidal.logging.reduce`'s contract)."""
    from tidal.logging.reduce import is_count

    last = key.rpartition("/")[2]
    if key.startswith("time/") or last.endswith("_s") or last == "seconds":
        return "s"
    if last.endswith("_gib"):
        return "GiB"
    if is_count(key):
        return "count"
    if last.endswith("_frac") or "accuracy" in last or last.startswith(("pass@", "mean@")) or last == "mfu":
        return "fraction"
    if last.endswith("tflops"):
        return "TFLOP/s"
    if "length" in last or last.endswith("_tokens"):
        return "tokens"
    if "grad_norm" in last:
        return "norm"
    if last == "lr" or last.endswith("_lr"):
        return "lr"
    return ""


def constant_keys(series: Series) -> list[str]:
    """The keys whose every value is the same (listed, not plotted)."""
    return sorted(k for k, (_, values) in series.items() if len(values) > 1 and min(values) == max(values))


def _unplotted_constants(series: Series) -> list[str]:
    """The constant keys drawn as no curve: all but the reward and eval ones (:data:`HEADLINE`)."""
    return [k for k in constant_keys(series) if k.partition("/")[0] not in HEADLINE]


def identical_keys(series: Series) -> dict[str, str]:
    """``{key: earlier key}`` for each changing series equal to an earlier one (in key order) at every
    step: the same data under two names. A series with fewer than two distinct values is never
    called equal to another: two metrics at 0 all run (a reward and a KL) are equal by accident,
    and :func:`constant_keys` lists them with their value."""
    first: dict[tuple, str] = {}
    out = {}
    for key in sorted(series):
        steps, values = series[key]
        if len(set(values)) < 2:
            continue
        sig = (tuple(steps), tuple(values))
        if sig in first:
            out[key] = first[sig]
        else:
            first[sig] = key
    return out


def _by_scale(keys: list[str], scales: dict[str, float]) -> list[list[str]]:
    """``keys`` in runs of similar magnitude, smallest first: a run's largest magnitude is at most
    SCALE_RATIO times its smallest nonzero one (all-zero series join the smallest run)."""
    runs: list[list[str]] = []
    low = 0.0  # the smallest nonzero magnitude of the current run
    for key in sorted(keys, key=lambda k: (scales.get(k, 0.0), k)):
        mag = scales.get(key, 0.0)
        if runs and (mag == 0.0 or low == 0.0 or mag <= low * SCALE_RATIO):
            runs[-1].append(key)
            low = low or mag
        else:
            runs.append([key])
            low = mag
    return runs


def panels(keys: list[str], scales: dict[str, float] | None = None) -> list[tuple[str, list[str]]]:
    """``[(title, keys)]``: one panel per prefix group and unit in display order (the unit in the
    title, ``eval [count]``, where a group has several), at most MAX_LINES keys each. ``scales``
    (each key's largest absolute value): keys without a unit are split by magnitude (:func:`_by_scale`),
    the scale in the title (``actor [value] (~1e+01)``)."""
    by_prefix: dict[str, list[str]] = {}
    for key in keys:
        by_prefix.setdefault(key.partition("/")[0], []).append(key)
    groups: dict[str, list[str]] = {}
    for prefix in sorted(by_prefix, key=_group_rank):
        units = sorted({unit_of(k) for k in by_prefix[prefix]})
        for unit in units:
            title = prefix if len(units) == 1 else f"{prefix} [{unit or 'value'}]"
            members = [k for k in by_prefix[prefix] if unit_of(k) == unit]
            runs = _by_scale(members, scales) if scales is not None and not unit else [members]
            for run in runs:
                peak = max(scales.get(k, 0.0) for k in run) if len(runs) > 1 else 0.0
                groups[f"{title} (~{10 ** round(math.log10(peak)):.0e})" if peak else title] = run
    out = []
    for group in groups:
        members = sorted(groups[group])
        chunks = [members[i : i + MAX_LINES] for i in range(0, len(members), MAX_LINES)]
        for n, chunk in enumerate(chunks, start=1):
            out.append((group if len(chunks) == 1 else f"{group} ({n}/{len(chunks)})", chunk))
    return out


def phase_keys(series: Series) -> list[str]:
    """The ``time/<phase>`` keys stacked in the phase-time bar, largest mean first."""
    keys = [k for k in series if k.startswith("time/") and k.count("/") == 1 and k not in NOT_STACKED]
    return sorted(keys, key=lambda k: (-sum(series[k][1]) / len(series[k][1]), k))


def memory_keys(series: Series) -> list[str]:
    """The ``memory/*`` keys in GiB, drawn together in the memory timeline."""
    return sorted(k for k in series if k.startswith("memory/") and unit_of(k) == "GiB")


def scales_of(series: Series) -> dict[str, float]:
    """Each key's largest absolute value (the magnitude its axis must show)."""
    return {k: max(abs(v) for v in values) for k, (_, values) in series.items()}


def layout(series: Series) -> list[tuple[str, str, list[str]]]:
    """``[(kind, title, keys)]`` of every panel, in order: the reward and eval ``lines``, ``phases``,
    ``memory``, then the other ``lines``."""
    special = []
    if phases := phase_keys(series):
        special.append(("phases", "phase time per step [s]", phases))
    if memory := memory_keys(series):
        special.append(("memory", "memory timeline [GiB]", memory))
    skip = {k for _, _, keys in special for k in keys} | set(_unplotted_constants(series))
    if phases and "time/step" in series:
        skip.add("time/step")  # the line over the stacked bars
    lines = [("lines", title, keys) for title, keys in panels([k for k in series if k not in skip], scales_of(series))]
    first = [p for p in lines if p[2][0].partition("/")[0] in HEADLINE]
    out = first + special + [p for p in lines if p not in first]
    return out or [("lines", "no changing metric", [])]


def _draw_phases(ax, series: Series, keys: list[str]) -> None:
    steps = sorted({s for k in keys for s in series[k][0]})
    stacked = [[dict(zip(*series[k])).get(s, 0.0) for s in steps] for k in keys]
    labels = [k.removeprefix("time/") for k in keys]
    if len(steps) > BAR_STEPS:
        ax.stackplot(steps, *stacked, labels=labels, step="mid")
    else:
        width = 0.8 * min((b - a for a, b in zip(steps, steps[1:])), default=1)
        bottom = [0.0] * len(steps)
        for label, values in zip(labels, stacked):
            ax.bar(steps, values, width=width, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
    if "time/step" in series:
        ax.plot(*series["time/step"], color="black", linewidth=1, marker=".", markersize=3, label="step (sum)")
    ax.set_ylabel("s")


def _draw_lines(ax, series: Series, keys: list[str], constant: set[str], prefix: str = "",
                same: dict[str, str] | None = None) -> None:
    """One line per key; a constant one dashed; one equal to another (``same``) dashed and thicker
    under a label that names the other, so that both show."""
    same = same or {}
    for key in keys:
        steps, values = series[key]
        label = key.removeprefix(prefix) + (f" (= {same[key].removeprefix(prefix)})" if key in same else "")
        ax.plot(steps, values, marker="o" if len(steps) <= 20 else None, markersize=3, linewidth=2.4 if key in same else 1.2,
                linestyle="--" if key in constant or key in same else "-", label=label, zorder=3 if key in same else 2)


def build_figure(series: Series, title: str):
    """The matplotlib figure of :func:`layout`'s panels (constrained layout: no title overlaps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panes = layout(series)
    constant = set(constant_keys(series))
    same = identical_keys(series)
    ncols = min(3, len(panes))
    nrows = -(-len(panes) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 3.8 * nrows), squeeze=False, layout="constrained")
    for ax, (kind, panel_title, keys) in zip(axes.flat, panes):
        if kind == "phases":
            _draw_phases(ax, series, keys)
        elif kind == "memory":
            _draw_lines(ax, series, keys, constant, prefix="memory/", same=same)
            ax.set_ylabel("GiB")
        else:
            _draw_lines(ax, series, keys, constant, same=same)
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if keys:
            ax.legend(fontsize=7, loc="best", ncol=2 if len(keys) > 6 else 1)
    for ax in list(axes.flat)[len(panes) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig


def render_png(series: Series, title: str) -> bytes:
    import matplotlib.pyplot as plt

    fig = build_figure(series, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def headline(series: Series) -> list[tuple[str, float, float]]:
    """``[(key, start, end)]`` of what the run is for: the trained reward (``reward/mean``, else
    ``reward/total``) and each eval accuracy (``eval/*`` fractions; without one, the eval reward)."""
    keys = [k for k in ("reward/mean", "reward/total") if k in series][:1]
    accuracies = sorted(k for k in series if k.startswith("eval/") and unit_of(k) == "fraction")
    keys += accuracies or [k for k in ("eval/greedy_reward",) if k in series]  # a reward model: no accuracy
    return [(k, series[k][1][0], series[k][1][-1]) for k in keys]


def render_html(series: Series, png: bytes, title: str, config_text: str | None = None) -> str:
    """The page: the headline (start -> end), the figure, each key's start and end values (a key
    equal to another says so), the constant keys, and the resolved config when given."""
    same = identical_keys(series)
    constant = _unplotted_constants(series)
    listed = "".join(f"<tr><td>{html.escape(k)}</td><td>{series[k][1][0]:.6g}</td></tr>" for k in constant)
    rows = []
    for _, keys in panels(list(series)):
        for key in keys:
            steps, values = series[key]
            note = f" (= {html.escape(same[key])})" if key in same else ""
            rows.append(f"<tr><td>{html.escape(key)}{note}</td><td>{values[0]:.6g}</td><td>{steps[0]}</td>"
                        f"<td>{values[-1]:.6g}</td><td>{steps[-1]}</td></tr>")
    last_step = max(s[-1] for s, _ in series.values())
    alt = "metric curves: " + "; ".join(t for _, t, _ in layout(series))
    head = "".join(f"<li><b>{html.escape(k)}</b>: {a:.4g} at the start, {b:.4g} at the end</li>" for k, a, b in headline(series))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{len(series)} metrics, last step {last_step}</p>"
        + (f"<ul>{head}</ul>" if head else "")
        + f"<img alt='{html.escape(alt, quote=True)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        "<h2>Metrics</h2><table><tr><th>metric</th><th>start</th><th>at step</th><th>end</th><th>at step</th></tr>"
        + "".join(rows)
        + "</table>"
        + (f"<h2>Constant (not plotted)</h2><table><tr><th>metric</th><th>value</th></tr>{listed}</table>" if constant else "")
        + (f"<h2>Resolved config</h2><pre>{html.escape(config_text)}</pre>" if config_text is not None else "")
        + "</body></html>\n"
    )


def write_report(run_dir: Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` into ``run_dir``; returns their paths."""
    metrics = run_dir / "metrics.jsonl"
    if not os.path.lexists(metrics):
        raise FileNotFoundError(f"{metrics} not found (is 'jsonl' in logging.backends?)")
    series = load_series(metrics)
    if not series:
        raise ValueError(f"{metrics} holds no numeric metrics")
    title = f"Tidal run {run_dir.resolve().name}"
    png = render_png(series, title)
    png_path, html_path = run_dir / "report.png", run_dir / "report.html"
    png_path.write_bytes(png)
    config = run_dir / "config.yaml"  # the resolved config the run wrote at its start
    config_text = config.read_text(encoding="utf-8") if config.is_file() else None  # is_file: no pipe, no device
    html_path.write_text(render_html(series, png, title, config_text), encoding="utf-8")
    return png_path, html_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal report", description="Draw a run's metric curves (report.png, report.html).")
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        png_path, html_path = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"tidal report: {e}", file=sys.stderr)
        return 1
    print(f"wrote {png_path} and {html_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
