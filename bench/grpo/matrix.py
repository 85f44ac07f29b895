"""The workload matrix (issue 20 item 1, issue 25: distillation cases): one JSON line per case,
Tidal on every selected case and TRL 1.16 (HF ``generate``) where ``--trl`` selects it (never on a
distillation case), each case in its own subprocess with its own time limit.

    python -m bench.grpo matrix --list                       # the case names
    python -m bench.grpo matrix --cases '0.5b-512x1024-*' --trl '0.5b-*' --time-budget-s 540 --record $OUT/matrix.jsonl
    python -m bench.grpo matrix --cases '0.5b-512x1024-natural-distill1.5b' --record $OUT/matrix.jsonl
    python -m bench.grpo matrix --tiny                       # CPU: the tiny model, 5 cases
    python -m bench.grpo matrix --long-tail --cases '1.5b-128x8192-natural-heavy*' --record $OUT/matrix.jsonl

A case line (``figure: "case"``) holds the workload (``size``, ``seqs``, ``prompt_len``,
``max_new_tokens``, ``lengths``, ``partial_rollout``, ``rollout_mode``: ``plain``, ``carry`` or
``drop``, with the medians of its ``partial/*`` metrics in ``partial``; ``teacher_size``: null, or
the distillation teacher's size, whose forward is the ``teacher_logprobs`` phase with its bound),
Tidal's steady ``iteration_s`` (median) and
``first_iteration_s``, its ``phases`` (medians of ``time/<phase>``) against their ``bounds``
(:mod:`bench.grpo.bounds`, from each iteration's own completion lengths: real tokens only),
``real_tokens`` and ``generated_tokens`` per iteration, ``generated_tokens_per_s`` (whole
iteration) and ``generate_tokens_per_s`` (the generate phase), the train phase's ``mfu``, peak
memory (measured, and ``predicted_peak_gib`` from the memory plan when the trainer has one), the
engine's host milliseconds per engine step, TRL's figures (null where TRL did not run), the checks
and ``error`` (null, or why the case has no figures). Multi-turn keys (``turns``,
``tool_latency_ms``) are null: these cases are single-turn.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.grpo.bounds import train_mfu
from bench.grpo.e2e import TRL_MISSING, add_common_args, resolve_device, trl_available
from bench.grpo.profile import PROFILE_EXTRA_S, profile_figure
from bench.grpo.record import REPO, gib, git_commit
from bench.grpo.session import Session, median_bounds, median_or_none
from bench.grpo.settings import RunSettings
from bench.grpo.shapes import FAMILY_SHAPES
from bench.grpo.workloads import Workload, family_matrix, long_tail_matrix, matrix, select, tiny_matrix

DEFAULT_RECORD = os.path.join(REPO, "bench", "results", "matrix.jsonl")
# Seconds each framework's subprocess of a case may take (--case-timeout-s overrides), and the
# least a case needs left in the run's budget to start.
CASE_TIMEOUT_S = {"tiny": 120, "tiny2": 120, "0.5b": 300, "1.5b": 360, "3b": 480, "7b": 570,
                  **{size: 240 for size in FAMILY_SHAPES}}
CASE_MIN_S = 60
MATRIX_SETTINGS = dict(tidal_warmup=1, tidal_steps=3, trl_warmup=1, trl_steps=2)
TINY_SETTINGS = dict(tidal_warmup=1, tidal_steps=2, trl_warmup=1, trl_steps=1)
FAMILY_SETTINGS = dict(tidal_warmup=1, tidal_steps=1, trl_warmup=1, trl_steps=1)  # two GRPO iterations


def case_line(w: Workload, tidal: dict | None, trl: dict | None, *, shape: dict, ceilings, bounds_per_step: list[dict],
              tidal_set: list[str]) -> dict:
    """The ``case`` figure of one workload from its Tidal and TRL summaries (either may be None:
    not run) and the bounds of each steady Tidal iteration."""
    t = tidal or {}
    steady = t.get("steady_s") or []
    lengths = t.get("lengths_per_step") or []
    per_step = t.get("phases_per_step") or []
    generated = [sum(x) for x in lengths]
    real = [w.prompt_len * len(x) + sum(x) for x in lengths]
    host = t.get("engine_host") or {}
    error = t.get("error") or (None if steady else ("not run" if tidal is None else "no steady iteration finished"))
    mfu = [train_mfu(shape, prompt_len=w.prompt_len, completion_lens=x, seconds=p.get("train"), c=ceilings)
           for x, p in zip(lengths, per_step)] if ceilings else []
    return {
        "size": w.size, "seqs": w.seqs, "prompts": w.prompts, "samples": w.samples, "prompt_len": w.prompt_len,
        "max_new_tokens": w.max_new_tokens, "lengths": w.lengths, "partial_rollout": w.partial_rollout,
        "rollout_mode": w.rollout, "partial": t.get("partial"), "kl": w.kl, "tail": w.tail,
        "teacher_size": w.teacher, "case": w.name, "iteration_s": median_or_none(steady), "steady_s": steady,
        "first_iteration_s": t.get("first_iteration_s"), "phases": t.get("phases") or {},
        "bounds": median_bounds(bounds_per_step),
        "iteration_bound_s": median_or_none([sum(b.values()) for b in bounds_per_step]),
        "real_tokens": median_or_none(real), "generated_tokens": median_or_none(generated),
        "generated_tokens_per_s": median_or_none([g / s for g, s in zip(generated, steady)]),
        "generate_tokens_per_s": median_or_none([g / p["generate"] for g, p in zip(generated, per_step) if p.get("generate")]),
        "mfu": median_or_none(mfu),
        "peak_allocated_gib": gib(t.get("peak_allocated")), "peak_reserved_gib": gib(t.get("peak_reserved")),
        "predicted_peak_gib": t.get("predicted_peak_gib"),
        "peak_over_plan": (gib(t["peak_allocated"]) / t["predicted_peak_gib"] - 1.0
                           if t.get("peak_allocated") and t.get("predicted_peak_gib") else None),
        "mismatch": t.get("mismatch"),
        "host_ms_per_decode_step": host.get("host"), "device_ms_per_decode_step": host.get("device"),
        "wait_ms_per_decode_step": host.get("wait"), "engine_steps": host.get("engine_steps"),
        "decode_steps": host.get("decode_steps"), "ahead_frac": host.get("ahead_frac"),
        "trl_iteration_s": median_or_none((trl or {}).get("steady_s") or []),
        "trl_first_iteration_s": (trl or {}).get("first_iteration_s"),
        "trl_generate_s": ((trl or {}).get("phases") or {}).get("generate"),
        "trl_peak_allocated_gib": gib((trl or {}).get("peak_allocated")),
        "trl_checks_ok": all(trl["checks"].values()) if trl else None, "trl_error": (trl or {}).get("error"),
        "turns": None, "tool_latency_ms": None,
        "checks_ok": all(t["checks"].values()) if tidal else None, "checks": t.get("checks"),
        "stopped_early": t.get("stopped_early"),
        "ceilings": {"copy_bw_GBps": ceilings.copy_bw / 1e9, "bf16_TFLOPs": ceilings.matmul_flops / 1e12} if ceilings else None,
        "tidal_set": tidal_set, "error": error,
    }


def case_timeout_s(w: Workload) -> float:
    """The default time limit of a case's subprocess: its student's, or its teacher's when larger."""
    return max(CASE_TIMEOUT_S.get(z, max(CASE_TIMEOUT_S.values())) for z in filter(None, (w.size, w.teacher)))


class Matrix:
    """The parent of one matrix run: selected cases in matrix order, one line each."""

    def __init__(self, args, settings: RunSettings):
        self.args = args
        self.session = Session(args, settings, record_path=args.record, work_dir_name="tidal-grpo-matrix")
        self.lines: list[dict] = []

    def run(self, workloads: list[Workload], trl_cases: set[str]) -> None:
        profile_case = workloads[0].name if self.args.profile and workloads else None
        for w in workloads:
            self.run_case(w, with_trl=w.name in trl_cases, profiled=w.name == profile_case)

    def run_case(self, w: Workload, *, with_trl: bool, profiled: bool) -> None:
        timeout = self.args.case_timeout_s or case_timeout_s(w)
        need = CASE_MIN_S if not self.args.tiny else 5
        s = self.session
        tidal = trl = None
        if s.remaining() < need:
            self.emit_case(w, None, None, error=f"skipped: time budget, {s.remaining():.0f} s left")
            return
        profile = {"dir": os.path.abspath(self.args.profile), "trace_max_mb": self.args.profile_trace_mb} if profiled else None
        tidal, tail = s.run_case("tidal", w, budget_s=min(s.remaining(), timeout + (PROFILE_EXTRA_S if profiled else 0)),
                                 tag=f"tidal-{w.name}", tidal_set=list(self.args.tidal_set), profile=profile)
        if tidal.get("error") or not tidal["steady_s"]:
            s.emit("error", record=False, framework="tidal", case=w.name, rc=tidal["rc"], log_tail=tail,
                   message=tidal.get("error") or "no steady iteration finished")
        if profiled:
            tidal["profile"] = tidal.get("profile") or {"error": "the worker left no profile record (see its error line)"}
            s.emit("profile", record=False, case=w.name, **profile_figure(tidal, self.args.profile))
        if with_trl and s.remaining() >= need:
            trl, tail = s.run_case("trl", w, budget_s=min(s.remaining(), timeout), tag=f"trl-{w.name}", tidal_set=[])
            if trl.get("error") or not trl["steady_s"]:
                s.emit("error", record=False, framework="trl", case=w.name, rc=trl["rc"], log_tail=tail,
                       message=trl.get("error") or "no steady iteration finished")
        self.emit_case(w, tidal, trl)

    def emit_case(self, w: Workload, tidal: dict | None, trl: dict | None, error: str | None = None) -> None:
        s = self.session
        per_step = s.bounds_per_step(w, (tidal or {}).get("lengths_per_step") or [],
                                     old_logprobs="actor_logprobs" in ((tidal or {}).get("phases") or {}),
                                     experts_touched_per_step=(tidal or {}).get("experts_touched_per_step"))
        line = case_line(w, tidal, trl, shape=s.models[w.size]["shape"] if w.size in s.models else {},
                         ceilings=s.ceilings, bounds_per_step=per_step, tidal_set=list(self.args.tidal_set))
        if error:
            line["error"] = error
        self.lines.append(s.emit("case", **line))

    def finish(self, workloads: list[Workload]) -> None:
        done = {x["case"]: x for x in self.lines}
        self.session.emit("summary", record=False, elapsed_s=time.time() - self.session.t_start,
                          cases_planned=[w.name for w in workloads],
                          cases={name: {"iteration_s": x["iteration_s"], "trl_iteration_s": x["trl_iteration_s"],
                                        "generate_s": x["phases"].get("generate"), "train_s": x["phases"].get("train"),
                                        "mfu": x["mfu"], "peak_gib": x["peak_allocated_gib"], "checks_ok": x["checks_ok"],
                                        "error": x["error"]} for name, x in done.items()})
        self.session.finish()


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m bench.grpo matrix", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="", help="comma list of case-name patterns (shell style, e.g. '0.5b-512x1024-*'); "
                                               "default: every case")
    p.add_argument("--trl", default="", help="comma list of case-name patterns where TRL runs too (default: none; "
                                             "never a distillation case)")
    p.add_argument("--list", action="store_true", help="print the case names (after --cases) and exit")
    p.add_argument("--long-tail", action="store_true", help="the long-tail matrix (reasoning-shaped natural lengths: "
                                                               "two tails, groups of 8 and 16, 2k-16k new tokens) instead of the matrix")
    p.add_argument("--families", action="store_true", help="the GPU check of every model family (bench.grpo.shapes."
                                                              "FAMILY_SHAPES, about 1-2B, and the dense 0.5B): two GRPO "
                                                              "iterations each, mismatch and peak against plan recorded")
    p.add_argument("--case-timeout-s", type=float, default=None,
                   help=f"seconds each framework's subprocess of a case may take (default by size: {CASE_TIMEOUT_S})")
    p.add_argument("--warmup", type=int, default=None, help="untimed first iterations of each case (default 1)")
    add_common_args(p, default_record=DEFAULT_RECORD)
    args = p.parse_args(argv)
    args.commit = args.commit or git_commit()
    return args


def _patterns(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def trl_selection(workloads: list[Workload], patterns: list[str]) -> list[Workload]:
    """The cases among ``workloads`` where TRL runs too: those ``patterns`` match (none without
    patterns), distillation and long-tail cases left out (the TRL runner has no teacher and no
    partial rollout: its figures belong on the plain cases); a pattern that matches no case TRL can
    run is an error."""
    if not patterns:
        return []
    return select([w for w in workloads if w.teacher is None and not w.partial_rollout], patterns,
                  option="--trl (TRL runs only plain cases: no distillation, no long-tail rollout)")


def settings_of(args) -> RunSettings:
    kw = dict(TINY_SETTINGS if args.tiny else FAMILY_SETTINGS if args.families else MATRIX_SETTINGS)
    if args.steps:
        kw["tidal_steps"] = kw["trl_steps"] = args.steps
    if args.warmup is not None:
        kw["tidal_warmup"] = kw["trl_warmup"] = args.warmup
    return RunSettings(**kw, trl_micro_batch=args.trl_micro_batch, trl_dtype=args.trl_dtype,
                       trl_gradient_checkpointing=args.trl_gradient_checkpointing)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    everything = (tiny_matrix() if args.tiny else long_tail_matrix() if args.long_tail else family_matrix() if args.families
                  else matrix())
    try:
        workloads = select(everything, _patterns(args.cases))
        trl_cases = {w.name for w in trl_selection(workloads, _patterns(args.trl))}
    except ValueError as e:
        raise SystemExit(str(e))
    if args.list:
        for w in workloads:
            print(w.name + ("  (+ TRL)" if w.name in trl_cases else ""))
        return 0
    if args.families and not any(x.startswith("train.old_logprobs=") for x in args.tidal_set):
        # the check records the engine-versus-trainer mismatch: the trainer's own old-logprob pass
        args.tidal_set = [*args.tidal_set, "train.old_logprobs=recompute"]
    args.device = resolve_device(args.device, args.tiny)
    run = Matrix(args, settings_of(args))
    if trl_cases and not trl_available():
        run.session.emit("error", record=False, framework="trl", message=TRL_MISSING)
        trl_cases = set()
    if workloads and run.session.setup(workloads, emit=lambda fig, **kw: run.session.emit(fig, record=False, **kw)):
        run.run(workloads, trl_cases)
    else:
        for w in workloads:
            run.emit_case(w, None, None, error="setup failed (see its error line)")
    run.finish(workloads)
    return 0
