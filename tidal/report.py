"""``tidal report RUN_DIR``: metric curves of a run as ``report.png`` and a self-contained ``report.html``.

Reads ``RUN_DIR/metrics.jsonl`` (as written by the ``jsonl`` logging backend). When a step appears
more than once (a file appended to by a resumed run), its last record wins. Keys are grouped by
their prefix before the first ``/`` (a key without one is its own group) and by their unit
(:func:`unit_of`: seconds, GiB, counts, fractions, other values), so one axis never mixes a count of
200 with accuracies near 1; each group is one panel (split into several when it has more than
``MAX_LINES`` keys). A series that never changes is not plotted: the HTML lists it with its value. Groups are ordered reward,
eval, kl, entropy, response/length, loss, time, memory, then the rest alphabetically. Non-numeric
and null values are skipped. The HTML page embeds the PNG (base64) and a table of each key's last
value; it references no external file.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from pathlib import Path

MAX_LINES = 8
GROUP_ORDER = ["reward", "eval", "kl", "entropy", "response", "length", "loss", "time", "memory", "gpu"]

Series = dict[str, tuple[list[int], list[float]]]


def load_series(path: Path) -> Series:
    """``{key: (steps, values)}`` from a metrics.jsonl, the last record of a step winning."""
    by_step: dict[int, dict] = {}
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
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
    if last.endswith("_frac") or "accuracy" in last or last.startswith(("pass@", "mean@")):
        return "fraction"
    return ""


def constant_keys(series: Series) -> list[str]:
    """The keys whose every value is the same (listed, not plotted)."""
    return sorted(k for k, (_, values) in series.items() if len(values) > 1 and min(values) == max(values))


def panels(keys: list[str]) -> list[tuple[str, list[str]]]:
    """``[(title, keys)]``: one panel per prefix group and unit in display order (the unit in the
    title, ``eval [count]``, where a group has several), at most MAX_LINES keys each."""
    by_prefix: dict[str, list[str]] = {}
    for key in keys:
        by_prefix.setdefault(key.partition("/")[0], []).append(key)
    groups: dict[str, list[str]] = {}
    for prefix in sorted(by_prefix, key=_group_rank):
        units = sorted({unit_of(k) for k in by_prefix[prefix]})
        for unit in units:
            title = prefix if len(units) == 1 else f"{prefix} [{unit or 'value'}]"
            groups[title] = [k for k in by_prefix[prefix] if unit_of(k) == unit]
    out = []
    for group in groups:
        members = sorted(groups[group])
        chunks = [members[i : i + MAX_LINES] for i in range(0, len(members), MAX_LINES)]
        for n, chunk in enumerate(chunks, start=1):
            out.append((group if len(chunks) == 1 else f"{group} ({n}/{len(chunks)})", chunk))
    return out


def render_png(series: Series, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = panels([k for k in series if k not in set(constant_keys(series))]) or [("no changing metric", [])]
    ncols = min(3, len(layout))
    nrows = -(-len(layout) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, (panel_title, keys) in zip(axes.flat, layout):
        for key in keys:
            steps, values = series[key]
            ax.plot(steps, values, marker="o" if len(steps) <= 20 else None, markersize=3, linewidth=1.2, label=key)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(layout) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def render_html(series: Series, png: bytes, title: str) -> str:
    rows = []
    constant = constant_keys(series)
    listed = "".join(f"<tr><td>{html.escape(k)}</td><td>{series[k][1][0]:.6g}</td></tr>" for k in constant)
    for panel_title, keys in panels(list(series)):
        for key in keys:
            steps, values = series[key]
            rows.append(f"<tr><td>{html.escape(key)}</td><td>{values[-1]:.6g}</td><td>{steps[-1]}</td></tr>")
    last_step = max(s[-1] for s, _ in series.values())
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
        "img{max-width:100%}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{len(series)} metrics, last step {last_step}</p>"
        f"<img alt='metric curves' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        "<h2>Final metrics</h2><table><tr><th>metric</th><th>last value</th><th>at step</th></tr>"
        + "".join(rows)
        + "</table>"
        + (f"<h2>Constant (not plotted)</h2><table><tr><th>metric</th><th>value</th></tr>{listed}</table>" if constant else "")
        + "</body></html>\n"
    )


def write_report(run_dir: Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` into ``run_dir``; returns their paths."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics} not found (is 'jsonl' in logging.backends?)")
    series = load_series(metrics)
    if not series:
        raise ValueError(f"{metrics} holds no numeric metrics")
    title = f"Tidal run {run_dir.resolve().name}"
    png = render_png(series, title)
    png_path, html_path = run_dir / "report.png", run_dir / "report.html"
    png_path.write_bytes(png)
    html_path.write_text(render_html(series, png, title), encoding="utf-8")
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
