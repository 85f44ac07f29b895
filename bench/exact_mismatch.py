"""Default mode against exact mode (``numerics.exact``) on one config: the rollout/trainer logprob
mismatch and the reward of each step, and the cost (seconds per step), from two `tidal train` runs
that differ in that switch only (same seed, same data order). Writes ``OUT/exact_vs_default.md``
(a table and a summary) and ``OUT/exact_vs_default.png`` (reward and mismatch curves); docs/exact.md
shows the committed output.

    python -m bench.exact_mismatch --out docs/exact --steps 40 engine.dtype=bfloat16 strategy.param_dtype=bfloat16

Extra arguments are overrides of both runs (``key=value``). ``--runs DIR`` keeps the two run folders
(default: a temporary folder); ``--reuse`` reads runs already in ``--runs`` instead of training."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"default": [], "exact": ["numerics.exact=true"]}
SHARED = ["eval.every=0", "eval.at_start=false", "eval.at_end=false", "checkpoint.every=0", "checkpoint.at_end=false",
          "logging.backends=[jsonl]"]


def train(config: str, run_dir: Path, steps: int, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "tidal.cli", "train", config, f"run.output_dir={run_dir}", f"run.steps={steps}", *SHARED, *overrides]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ))


def read(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/mismatch_abs_logp_diff" in r]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary(runs: dict[str, list[dict]], overrides: list[str]) -> str:
    d, e = runs["default"], runs["exact"]
    k = max(1, len(d) // 5)
    t_d, t_e = mean([r["time/step"] for r in d[1:]]), mean([r["time/step"] for r in e[1:]])
    lines = [
        f"Overrides: `{' '.join(overrides) or '(none)'}`; {len(d)} steps each (the first step's time left out of the means).",
        "",
        "| | default | exact |",
        "| --- | --- | --- |",
        f"| mismatch `actor/mismatch_abs_logp_diff`, first {k} steps (mean) | {mean([r['actor/mismatch_abs_logp_diff'] for r in d[:k]]):.3g} "
        f"| {mean([r['actor/mismatch_abs_logp_diff'] for r in e[:k]]):.3g} |",
        f"| mismatch, last {k} steps (mean) | {mean([r['actor/mismatch_abs_logp_diff'] for r in d[-k:]]):.3g} "
        f"| {mean([r['actor/mismatch_abs_logp_diff'] for r in e[-k:]]):.3g} |",
        f"| steps with mismatch exactly 0.0 | {sum(r['actor/mismatch_abs_logp_diff'] == 0.0 for r in d)}/{len(d)} "
        f"| {sum(r['actor/mismatch_abs_logp_diff'] == 0.0 for r in e)}/{len(e)} |",
        f"| reward, first {k} steps (mean) | {mean([r['reward/mean'] for r in d[:k]]):.3f} | {mean([r['reward/mean'] for r in e[:k]]):.3f} |",
        f"| reward, last {k} steps (mean) | {mean([r['reward/mean'] for r in d[-k:]]):.3f} | {mean([r['reward/mean'] for r in e[-k:]]):.3f} |",
        f"| seconds per step (mean) | {t_d:.3f} | {t_e:.3f} |",
        "",
        f"Cost ratio exact/default: **{t_e / t_d:.2f}x** (seconds per step).",
        "",
        "| step | mismatch default | mismatch exact | reward default | reward exact |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a, b in zip(d, e):
        lines.append(f"| {a['step']} | {a['actor/mismatch_abs_logp_diff']:.3g} | {b['actor/mismatch_abs_logp_diff']:.3g} "
                     f"| {a['reward/mean']:.3f} | {b['reward/mean']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(10, 3.6))
    for mode, rows in runs.items():
        steps = [r["step"] for r in rows]
        ax_r.plot(steps, [r["reward/mean"] for r in rows], label=mode)
        ax_m.plot(steps, [r["actor/mismatch_abs_logp_diff"] for r in rows], label=mode)
    ax_r.set(xlabel="step", ylabel="reward/mean", title="reward")
    ax_m.set(xlabel="step", ylabel="actor/mismatch_abs_logp_diff", title="rollout vs trainer logprob mismatch")
    ax_m.set_yscale("symlog", linthresh=1e-8)
    for ax in (ax_r, ax_m):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="quickstart")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    runs_dir = args.runs or Path(tempfile.mkdtemp(prefix="tidal-exact-"))
    runs = {}
    for mode, extra in MODES.items():
        if not args.reuse:
            train(args.config, runs_dir / mode, args.steps, overrides + extra)
        runs[mode] = read(runs_dir / mode)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exact_vs_default.md").write_text(summary(runs, overrides))
    plot(runs, args.out / "exact_vs_default.png")
    print((args.out / "exact_vs_default.md").read_text().split("\n\n| step")[0])


if __name__ == "__main__":
    main()
