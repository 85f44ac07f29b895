"""Tidal against TRL's ``GRPOTrainer`` on one GPU, one GRPO iteration end to end (issue 8).

Both frameworks train the same random-initialised model folder (bf16 on disk, loaded as fp32 master
weights with bf16 compute by both) on the same batch: 16 prompts x 8 samples, prompt 128 tokens,
256 completion tokens (``--lengths forced``, the default; ``natural``: the drawn lengths of
:mod:`bench.grpo.workloads`, EOS-terminated in both), one optimizer step per rollout, the same
reward (:mod:`bench.grpo.rewards`). Each (framework, size, KL) case runs in its own subprocess.
Sizes 0.5b (main) and 1.5b by default (any of :data:`~bench.grpo.shapes.SHAPES`); KL off and on
(coefficient 0.04, k3, a reference model). Cases run in priority order (:func:`plan_cases`); one
that cannot start inside the budget is ``skipped``, one that runs out of time stops after its
current step. Figures: see bench/README.md; bounds: :mod:`bench.grpo.bounds`; the profile:
:mod:`bench.grpo.profile`.

    python -m bench.grpo e2e [--only tidal|trl] [--sizes 0.5b,1.5b] [--kl off|on|both] [--lengths forced|natural]
        [--time-budget-s 480] [--record [PATH]] [--out-dir DIR] [--tidal-set key=value ...]
        [--profile DIR [--profile-trace-mb 15]]
    python -m bench.grpo e2e --tiny          # CPU smoke run: tiny model, 2 prompts x 2 samples, 8 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import time

from bench.grpo.profile import PROFILE_EXTRA_S, TRACE_MAX_MB, profile_figure
from bench.grpo.record import REPO, gib, git_commit
from bench.grpo.session import Session, median_bounds, median_or_none
from bench.grpo.settings import RunSettings
from bench.grpo.shapes import SHAPES
from bench.grpo.workloads import LENGTH_MODES, Workload

DEFAULT_RECORD = os.path.join(REPO, "bench", "results", "e2e_grpo.jsonl")
# Seconds a case is allowed at most (it stops after the step that would overrun) and needs at least to start.
CASE_CAP_S = {("tidal", "0.5b"): 180, ("tidal", "1.5b"): 220, ("trl", "0.5b"): 150, ("trl", "1.5b"): 220}
CASE_CAP_DEFAULT_S = 400
CASE_MIN_S = 45
# Tidal settings of this benchmark: two training micro-batches of 64 sequences (the default
# 16384-token budget splits 128 x 384 tokens into 42+42+42+2), and a KV cache just large enough.
TIDAL_MICRO_BATCH_TOKENS = 49152
BASE = dict(prompts=16, samples=8, prompt_len=128, max_new_tokens=256)
TINY = dict(prompts=2, samples=2, prompt_len=8, max_new_tokens=8)
TINY_SETTINGS = dict(tidal_warmup=1, tidal_steps=2, trl_warmup=1, trl_steps=2, trl_micro_batch=2)


@dataclasses.dataclass(kw_only=True, frozen=True)
class Case:
    framework: str
    size: str
    kl: bool

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.size}-kl{'on' if self.kl else 'off'}"


def plan_cases(frameworks: list[str], sizes: list[str], kls: list[bool]) -> list[Case]:
    """Cases in priority order: by level (size index + KL on), Tidal before TRL within a level, then
    the first size first: 0.5b off (tidal, trl), then tidal 0.5b on, tidal 1.5b off, trl 0.5b on, ..."""
    cases = [Case(framework=f, size=z, kl=k) for f in frameworks for z in sizes for k in kls]
    rank = {z: i for i, z in enumerate(sizes)}
    return sorted(cases, key=lambda c: (rank[c.size] + int(c.kl), c.framework != "tidal", rank[c.size], c.kl))


def tidal_base_settings(w: Workload) -> list[str]:
    """This benchmark's Tidal settings (before ``--tidal-set``): see :data:`TIDAL_MICRO_BATCH_TOKENS`."""
    kv_tokens = 1 << math.ceil(math.log2(w.seqs * (w.prompt_len + w.max_new_tokens + 16)))
    return [f"train.micro_batch_tokens={TIDAL_MICRO_BATCH_TOKENS}", f"engine.kv_cache_max_tokens={kv_tokens}"]


class E2E:
    """The parent of one e2e run: cases, their workers, the figures."""

    def __init__(self, args, settings: RunSettings):
        self.args = args
        self.session = Session(args, settings, record_path=args.record, work_dir_name="tidal-e2e-grpo")
        self.settings = settings
        self.results: dict[Case, dict] = {}
        self.workloads: dict[Case, Workload] = {}
        self.profile_case: Case | None = None

    def emit(self, figure: str, **fields) -> None:
        self.session.emit(figure, **fields)

    def workload(self, case: Case) -> Workload:
        base = TINY if self.args.tiny else BASE
        return Workload(size=case.size, kl=case.kl, lengths=self.args.lengths, **base)

    def run_case(self, case: Case) -> None:
        cap = CASE_CAP_S.get((case.framework, case.size), CASE_CAP_DEFAULT_S)
        profiled = case == self.profile_case
        cap += PROFILE_EXTRA_S if profiled else 0
        budget = min(self.session.remaining(), cap)
        if budget < (CASE_MIN_S if not self.args.tiny else 5):
            self.emit("skipped", case=case.name, reason=f"time budget: {self.session.remaining():.0f} s left")
            return
        w = self.workloads[case] = self.workload(case)
        profile = {"dir": os.path.abspath(self.args.profile), "trace_max_mb": self.args.profile_trace_mb} if profiled else None
        summary, tail = self.session.run_case(case.framework, w, budget_s=budget, tag=case.name,
                                              tidal_set=tidal_base_settings(w) + list(self.args.tidal_set), profile=profile)
        self.results[case] = summary
        if profiled and summary.get("profile") is None:
            summary["profile"] = {"error": "the worker left no profile record (killed or failed first: see the case's "
                                           "error line / logs.txt)"}
        self.report_case(case, summary, tail)

    # ---- figures -----------------------------------------------------------------------------------
    def report_case(self, case: Case, sm: dict, tail: str) -> None:
        base = {"framework": case.framework, "size": case.size, "kl": case.kl}
        if sm.get("error") or not sm["steady_s"]:
            self.emit("error", **base, rc=sm["rc"], message=sm.get("error") or "no timed iteration finished",
                      steps_s=sm["steps_s"], log_tail=tail)
            if not sm["steady_s"]:
                return
        self.emit("iteration", **base, median_s=median_or_none(sm["steady_s"]), steady_s=sm["steady_s"],
                  warmup_s=sm["warmup_s"], init_s=sm.get("init_s"), stopped_early=sm["stopped_early"],
                  checks_ok=all(sm["checks"].values()), checks=sm["checks"])
        self.emit("peak_memory", **base, allocated_gib=gib(sm["peak_allocated"]), reserved_gib=gib(sm["peak_reserved"]))
        bounds = self.bounds(case, sm)
        for phase, seconds in sm["phases"].items():
            bound = bounds.get(phase)
            self.emit("phase", **base, phase=phase, median_s=seconds, bound_s=bound,
                      bound_over_measured=(bound / seconds) if bound and seconds else None)
        if case.framework == "tidal":
            self.report_tidal_extras(base, sm, bounds)
        self.report_ratio(case)

    def bounds(self, case: Case, sm: dict) -> dict[str, float]:
        """Median per phase of each steady iteration's bounds, from that iteration's completion lengths."""
        return median_bounds(self.session.bounds_per_step(self.workloads[case], sm["lengths_per_step"],
                                                          old_logprobs="actor_logprobs" in sm["phases"],
                                                          experts_touched_per_step=sm.get("experts_touched_per_step")))

    def report_tidal_extras(self, base: dict, sm: dict, bounds: dict) -> None:
        measured = median_or_none(sm["steady_s"])
        if bounds:
            total = sum(bounds.values())
            self.emit("iteration_bound", **base, bound_s=total, parts_s=bounds, measured_s=measured,
                      bound_over_measured=total / measured if measured else None)
        ws = sm["weight_sync"]
        if ws["seconds"]:
            c = self.session.ceilings
            t = statistics.median(ws["seconds"])
            self.emit("weight_sync", **base, bytes=ws["bytes"], median_s=t, GBps=ws["bytes"] / t / 1e9 if ws["bytes"] else None,
                      copy_bw_GBps=c.copy_bw / 1e9 if c else None, bound_s=bounds.get("weight_sync"),
                      bound_over_measured=bounds["weight_sync"] / t if bounds else None)
        if sm.get("engine_host"):
            self.emit("engine_host", **base, unit="host ms per engine step (median over steady iterations)",
                      **sm["engine_host"])
        if sm.get("profile"):
            self.report_profile(base, sm)
        if sm["timeline"]:
            self.emit("memory_timeline", **base, step=sm["timeline_step"],
                      unit="GiB allocated, GiB reserved (torch allocator), GiB used on the device (driver: all memory, "
                           "incl. the engine's fixed-address KV cache), [GiB peak allocated in the phase]",
                      points=[[p["label"], gib(p["allocated"]), gib(p["reserved"]), gib(p.get("device_used"))]
                              + ([gib(p["peak"])] if p.get("peak") else [])
                              for p in sm["timeline"]],
                      returned_bytes={c["name"]: c["returned"] for c in sm["timeline_calls"] if c["returned"] is not None})

    def report_profile(self, base: dict, sm: dict) -> None:
        self.emit("profile", **base, **profile_figure(sm, self.args.profile))

    def report_ratio(self, case: Case) -> None:
        tidal = self.results.get(Case(framework="tidal", size=case.size, kl=case.kl))
        trl = self.results.get(Case(framework="trl", size=case.size, kl=case.kl))
        if not (tidal and trl and tidal["steady_s"] and trl["steady_s"]):
            return
        a, b = median_or_none(trl["steady_s"]), median_or_none(tidal["steady_s"])
        mem_a, mem_b = trl["peak_allocated"], tidal["peak_allocated"]
        self.emit("ratio", size=case.size, kl=case.kl, trl_s=a, tidal_s=b, trl_over_tidal=a / b,
                  trl_peak_gib=gib(mem_a), tidal_peak_gib=gib(mem_b),
                  memory_trl_over_tidal=(mem_a / mem_b) if mem_a and mem_b else None)

    def finish(self, cases: list[Case]) -> None:
        main_size = cases[0].size if cases else None
        main_tidal = self.results.get(Case(framework="tidal", size=main_size, kl=False))
        main_trl = self.results.get(Case(framework="trl", size=main_size, kl=False))
        t = median_or_none(main_tidal["steady_s"]) if main_tidal else None
        r = median_or_none(main_trl["steady_s"]) if main_trl else None
        table = {c.name: {"median_s": median_or_none(sm["steady_s"]), "n": len(sm["steady_s"]),
                          "peak_gib": gib(sm["peak_allocated"]), "checks_ok": all(sm["checks"].values()),
                          "error": bool(sm.get("error"))} for c, sm in self.results.items()}
        self.emit("summary", elapsed_s=time.time() - self.session.t_start,
                  cases_run=[c.name for c in cases if c in self.results], cases_planned=[c.name for c in cases],
                  cases=table, tidal_main_s=t, trl_main_s=r, target_tidal_le_1s=(t <= 1.0) if t is not None else None,
                  target_ratio_ge_8=(r / t >= 8) if (t and r) else None)
        self.session.finish()


# ---- CLI -------------------------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser, *, default_record: str) -> None:
    """Options shared by ``e2e`` and ``matrix``."""
    p.add_argument("--time-budget-s", type=float, default=480.0, help="the whole run stops cleanly within this")
    p.add_argument("--record", nargs="?", const=default_record, default=None,
                   help=f"append the figures (with run id, commit, device, settings) to PATH (default {default_record})")
    p.add_argument("--out-dir", default=None, help="also write raw.jsonl (every worker record) and logs.txt (worker output) here")
    p.add_argument("--work-dir", default=None, help="model folders, prompts, worker files (default: under $TMPDIR)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny model")
    p.add_argument("--tidal-set", action="append", default=[], metavar="KEY=VALUE", help="override a Tidal config key")
    p.add_argument("--trl-micro-batch", type=int, default=None,
                   help="completions per TRL forward/backward (default: the largest divisor of the rollout within "
                        "16384 tokens)")
    p.add_argument("--trl-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="TRL model_init dtype (float32 = fp32 master weights + bf16 autocast, like Tidal)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true", help="TRL with gradient checkpointing (its default)")
    p.add_argument("--steps", type=int, default=None, help="timed iterations of each case")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one extra Tidal iteration of the first Tidal case (after the timed ones) with "
                        "torch.profiler; write phases.txt, summary.json and trace.json.gz into DIR")
    p.add_argument("--profile-trace-mb", type=float, default=TRACE_MAX_MB,
                   help=f"keep trace.json.gz only up to this size (default {TRACE_MAX_MB:g}; 0: no trace)")
    p.add_argument("--commit", default=None, help="commit recorded with the results (default: git or $TIDAL_COMMIT)")


def resolve_device(pref: str, tiny: bool) -> str:
    if pref != "auto":
        return pref
    if tiny:
        return "cpu"
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                             capture_output=True, text=True, timeout=120)
        return "cuda" if out.stdout.strip() == "True" else "cpu"
    except Exception:
        return "cpu"


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None and importlib.util.find_spec("datasets") is not None


TRL_MISSING = ("trl/datasets are not installed: run bench/prepare_wheels.sh where pip works, carry .whl, install with "
               "pip --target and PYTHONPATH (bench/README.md); TRL cases skipped")


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m bench.grpo e2e", description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["tidal", "trl"], help="run one framework only")
    p.add_argument("--sizes", default="0.5b,1.5b", help=f"comma list of {', '.join(SHAPES)} (first = main)")
    p.add_argument("--kl", choices=["off", "on", "both"], default="both", help="KL-off cases, KL-on cases, or both")
    p.add_argument("--lengths", choices=LENGTH_MODES, default="forced", help="completion lengths (bench/grpo/workloads.py)")
    add_common_args(p, default_record=DEFAULT_RECORD)
    args = p.parse_args(argv)
    args.commit = args.commit or git_commit()
    return args


def settings_of(args) -> RunSettings:
    kw = dict(TINY_SETTINGS) if args.tiny else {}
    if args.trl_micro_batch:
        kw["trl_micro_batch"] = args.trl_micro_batch
    if args.steps:
        kw["tidal_steps"] = kw["trl_steps"] = args.steps
    return RunSettings(**kw, trl_dtype=args.trl_dtype, trl_gradient_checkpointing=args.trl_gradient_checkpointing)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.device = resolve_device(args.device, args.tiny)
    sizes = ["tiny"] if args.tiny else [z.strip() for z in args.sizes.split(",") if z.strip()]
    bad = [z for z in sizes if z not in SHAPES]
    if bad:
        raise SystemExit(f"--sizes: unknown {bad}; known: {list(SHAPES)}")
    frameworks = [args.only] if args.only else ["tidal", "trl"]
    run = E2E(args, settings_of(args))
    if "trl" in frameworks and not trl_available():
        run.emit("error", framework="trl", message=TRL_MISSING)
        frameworks.remove("trl")
    kls = {"off": [False], "on": [True], "both": [False, True]}[args.kl]
    cases = plan_cases(frameworks, sizes, kls)
    if args.profile:
        run.profile_case = next((c for c in cases if c.framework == "tidal"), None)
        if run.profile_case is None:
            run.emit("profile", error="--profile needs a Tidal case: none is planned")
        else:
            os.makedirs(args.profile, exist_ok=True)
    if cases and run.session.setup([run.workload(c) for c in cases]):
        for case in cases:
            run.run_case(case)
    run.finish(cases)
    return 0
