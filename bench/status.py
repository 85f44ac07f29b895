"""Render the figures of README.md's Status section from ``bench/results/*.jsonl`` (issue 23 item 10).

Each row is one measured figure: what was measured (the case, as the benchmark names it), the
figure, and the commit and device of the run that measured it. Of several runs of one case, the
newest (by the record's ``time``, then file order) is shown. Lines with an ``error`` are skipped.

    python -m bench.status            # rewrite the table between the markers in README.md
    python -m bench.status --check    # exit 1 (and say so) when README.md's table is stale
    python -m bench.status --print    # print the table

Sources: ``e2e_grpo.jsonl`` (``summary``: per case, the median steady iteration and peak; the speed
targets), ``matrix.jsonl`` (``case``), ``families.jsonl`` (``case``: the GPU check of every family), ``memory_check.jsonl`` (``summary``: the memory plan's
predicted peak against the measured one), ``multiturn.jsonl`` (``case``), ``rollout.jsonl`` (engine
throughput lines: those with an ``engine``), ``speculative.jsonl`` (``part``: overhead and structured).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- status-figures -->", "<!-- /status-figures -->"
HEADER = "| figure | case | value | commit | device |\n| --- | --- | --- | --- | --- |"
Row = tuple[str, str, str, str, str]  # figure, case, value, commit, device


def read_jsonl(path: Path) -> list[dict]:
    """The records of ``path`` without those that carry an ``error`` (or are ``figure: error``),
    ordered by ``time`` (records without one first, in file order)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not rec.get("error") and rec.get("figure") != "error":
            out.append(rec)
    return sorted(out, key=lambda r: r.get("time") or "")


def newest(records: list[dict], key) -> list[dict]:
    """The newest record per ``key(record)``, in the order each key first appears."""
    by_key: dict = {}
    for rec in records:
        by_key[key(rec)] = rec
    return list(by_key.values())


def num(x: float) -> str:
    """Three significant digits, no exponent for the magnitudes these figures have."""
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def overrides(rec: dict) -> tuple[str, ...]:
    """The ``key=value`` overrides a run set (top level in older e2e records, under settings later)."""
    return tuple(rec.get("tidal_set") or rec.get("settings", {}).get("tidal_set") or ())


def with_overrides(case: str, rec: dict) -> str:
    sets = overrides(rec)
    return case + (f" with {', '.join(f'`{s}`' for s in sets)}" if sets else "")


def row(figure: str, case: str, value: str, rec: dict) -> Row:
    return figure, case, value, rec.get("commit", "?"), rec.get("device", "?")


def _e2e_order(t) -> tuple:
    """Plain runs first, then by size, KL, Tidal before TRL (case names are ``framework-size-klX``)."""
    framework, size, kl = t[1].split("-", 2)
    return len(overrides(t[0])), size, kl, framework != "tidal"


TARGET_MIN_STEADY = 3  # steady iterations a run's main Tidal case needs before it judges a speed target


def e2e_rows(records: list[dict]) -> list[Row]:
    """Per e2e case (framework, size, KL, overrides), its newest summary; TRL rows give the ratio to
    Tidal's same case in the same run; then the two speed targets from the newest runs without
    overrides that evaluated them on at least ``TARGET_MIN_STEADY`` steady iterations."""
    summaries = [r for r in records if r.get("figure") == "summary"]
    cases = [(s, name, c) for s in summaries for name, c in s["cases"].items()
             if not c.get("error") and c.get("median_s") is not None]
    rows = []
    for s, name, c in sorted(newest(cases, lambda t: (t[1], overrides(t[0]))), key=_e2e_order):
        value = f"{num(c['median_s'])} s per iteration (median of {c['n']} steady), peak {num(c['peak_gib'])} GiB"
        tidal = s["cases"].get(name.replace("trl-", "tidal-", 1), {})
        if name.startswith("trl-") and tidal.get("median_s"):
            value += f"; {c['median_s'] / tidal['median_s']:.1f}x Tidal's {num(tidal['median_s'])} s in the same run"
        if not c.get("checks_ok", True):
            value += " (self-checks failed)"
        rows.append(row("GRPO iteration, e2e", with_overrides(f"`{name}`", s), value, s))
    # a verdict needs a settled median: runs whose main Tidal case has fewer steady iterations do not judge
    plain = [s for s in summaries if not overrides(s)
             and (s["cases"].get("tidal-0.5b-kloff") or {}).get("n", 0) >= TARGET_MIN_STEADY]
    for target, what in (("target_tidal_le_1s", "Tidal <= 1 s per iteration"), ("target_ratio_ge_8", ">= 8x TRL")):
        seen = [s for s in plain if s.get(target) is not None]
        if seen:
            s = seen[-1]
            value = f"{'met' if s[target] else 'not met'}: Tidal {num(s['tidal_main_s'])} s"
            if s.get("trl_main_s"):
                value += f", TRL {num(s['trl_main_s'])} s ({s['trl_main_s'] / s['tidal_main_s']:.1f}x)"
            rows.append(row(f"speed target: {what}", "`tidal-0.5b-kloff`", value, s))
    return rows


def matrix_rows(records: list[dict]) -> list[Row]:
    """Per matrix case (its name says size, seqs x max new tokens, lengths, rollout mode, teacher)."""
    cases = [r for r in records if r.get("figure") == "case" and r.get("bench") != "multiturn"]
    rows = []
    for r in newest(cases, lambda r: (r["case"], overrides(r))):
        ph, bd = r["phases"], r["bounds"]
        value = f"{num(r['iteration_s'])} s per iteration; " + ", ".join(
            f"{p} {num(ph[p])} s (bound {num(bd[p])})" for p in ("generate", "teacher_logprobs", "train") if p in bd)
        value += f"; {num(r['generated_tokens_per_s'])} generated tok/s; peak {num(r['peak_allocated_gib'])} GiB"
        if r.get("trl_iteration_s"):
            value += f"; TRL {num(r['trl_iteration_s'])} s"
        case = f"`{r['case']}` (prompt {r['prompt_len']}{', KL on' if r.get('kl') else ''})"
        rows.append(row("GRPO iteration, matrix", with_overrides(case, r), value, r))
    return rows


def families_rows(records: list[dict]) -> list[Row]:
    """The GPU check of every family (``matrix --families``): per family and device, its iteration,
    phases against their bounds, peak against the plan, and the engine-versus-trainer mismatch."""
    cases = [r for r in records if r.get("figure") == "case" and not r.get("error")]
    rows = []
    for r in newest(cases, lambda r: (r["case"], r.get("device"))):
        ph, bd = r["phases"], r["bounds"]
        value = f"{num(r['iteration_s'])} s per iteration; " + ", ".join(
            f"{p} {num(ph[p])} s (bound {num(bd[p])})" for p in ("generate", "train") if p in bd and p in ph)
        if r.get("mfu"):
            value += f"; MFU {num(r['mfu'])}"
        if r.get("predicted_peak_gib"):
            value += f"; peak {num(r['peak_allocated_gib'])} GiB, plan {num(r['predicted_peak_gib'])} GiB"
        mm = r.get("mismatch") or {}
        if mm.get("abs_logp_diff_mean"):
            value += f"; mismatch mean {num(max(mm['abs_logp_diff_mean']))}, max {num(max(mm['logp_diff_max']))}"
        rows.append(row("model family on the GPU", f"`{r['case']}`", value, r))
    return rows


def memory_rows(records: list[dict]) -> list[Row]:
    summaries = [r for r in records if r.get("figure") == "memory_plan" and r.get("kind") == "summary"]
    key = lambda r: (r["size"], r["lora"], r["sequences"], r["prompt_len"], r["new_tokens"], tuple(r.get("set", ())))  # noqa: E731
    rows = []
    for r in newest(summaries, key):
        case = f"{r['size']}, {r['sequences']} seqs x ({r['prompt_len']} + {r['new_tokens']}) tokens" + (
            f", LoRA rank {r['lora']}" if r["lora"] else "")
        value = (f"predicted peak {r['predicted_peak_gib']:.1f} GiB, measured {r['measured_peak_gib']:.1f} GiB"
                 f" (ratio {r['ratio']:.2f})")
        rows.append(row("memory plan", case, value, r))
    return rows


def multiturn_rows(records: list[dict]) -> list[Row]:
    rows = []
    for r in newest([r for r in records if r.get("figure") == "case"], lambda r: r["case"]):
        value = f"{num(r['iteration_s'])} s per iteration, GPU idle {r['gpu_idle_frac']:.2f} of generate"
        if r.get("vs_single_turn"):
            value += f", {r['vs_single_turn']:.2f}x the single-turn iteration"
        case = f"`{r['case']}` (turns {r['turns']}, tool latency {num(r['tool_latency_ms'])} ms)"
        rows.append(row("multi-turn GRPO iteration", case, value, r))
    return rows


def rollout_rows(records: list[dict]) -> list[Row]:
    rows = []
    for r in newest([r for r in records if "engine" in r], lambda r: (r["case"], r["engine"], r["variant"])):
        case = f"`{r['case']}`: {r['seqs']} seqs, prompt {r['prompt_len']}, {r['new_tokens']} new tokens"
        value = f"{r['engine']} ({r['variant']}): {r['gen_tokens_per_s']:,.0f} generated tok/s"
        if r.get("roofline_fraction"):
            value += f", {r['roofline_fraction']:.0%} of the bandwidth roofline"
        rows.append(row("rollout", case, value, r))
    return rows


def speculative_rows(records: list[dict]) -> list[Row]:
    """Speculative rollouts: ``auto`` against ``off`` on random weights (overhead), and the three
    modes on the structured proxy model (each the newest record of its case and mode)."""
    rows = []
    over = {(r["case"], r["mode"]): r for r in newest([r for r in records if r.get("part") == "overhead"],
                                                      lambda r: (r["case"], r["mode"]))}
    for (case, mode), r in over.items():
        off = over.get((case, "off"))
        if mode != "auto" or off is None:
            continue
        what = f"`{case}`: {r['prompts']} x {r['n']}, prompt {r['prompt_len']}, up to {r['max_new_tokens']} new, random weights"
        value = (f"auto {r['wall_s']:.3g} s vs off {off['wall_s']:.3g} s ({r['wall_s'] / off['wall_s'] - 1:+.1%}); "
                 f"{r['counts']['spec_steps']} verify steps")
        rows.append(row("speculative rollout, overhead", what, value, r))
    proxy = {(r["prompts"], r["mode"]): r for r in newest([r for r in records if r.get("part") == "structured" and "mode" in r],
                                                          lambda r: (r["prompts"], r["mode"]))}
    for prompts in dict.fromkeys(p for p, _ in proxy):
        modes = {m: proxy[(prompts, m)] for m in ("off", "auto", "on") if (prompts, m) in proxy}
        on = modes.get("on") or modes.get("auto")
        what = f"{prompts} x {on['n']}, 0.5B trained on worked solutions (proxy), temperature 1"
        value = ", ".join(f"{m} {r['tokens_per_s']:,.0f}" for m, r in modes.items()) + " tok/s"
        value += f"; acceptance {on['spec_acceptance_rate']:.2f}, {on['spec_accepted_per_verify']:.2f} accepted per verify"
        rows.append(row("speculative rollout, structured", what, value, on))
    return rows


SOURCES = (("e2e_grpo", e2e_rows), ("matrix", matrix_rows), ("families", families_rows), ("memory_check", memory_rows),
           ("multiturn", multiturn_rows), ("rollout", rollout_rows), ("speculative", speculative_rows))


def render(results: Path = RESULTS) -> str:
    """The markdown table of every figure in ``results`` (files that do not exist are left out)."""
    lines = [HEADER]
    for stem, rows_of in SOURCES:
        path = results / f"{stem}.jsonl"
        if path.exists():
            for cells in rows_of(read_jsonl(path)):
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """The text between the markers of ``text`` (README.md), stripped."""
    if START not in text or END not in text:
        raise ValueError(f"README.md has no {START} ... {END} block")
    return text[text.index(START) + len(START): text.index(END)].strip()


def replace_block(text: str, table: str) -> str:
    readme_block(text)  # the markers exist
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.status", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    mode.add_argument("--print", action="store_true", help="print the table, change nothing")
    args = ap.parse_args(argv)
    table, text = render(), README.read_text()
    if args.print:
        print(table)
    elif args.check:
        if readme_block(text) != table:
            print("README.md Status figures are stale: run `python -m bench.status`", file=sys.stderr)
            return 1
        print("README.md Status figures are current")
    else:
        README.write_text(replace_block(text, table))
        print(f"wrote {table.count(chr(10)) - 1} figures to {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
