"""The Tidal runner: a worker that builds Tidal's trainer for one case and times ``train_step``
iterations, and the summary of its records.

Tidal is observed through public extension points only: ``trainer.timer.add_observer`` (phase
boundaries, placement moves with bytes, each rollout's lengths and finish reasons:
:class:`~bench.grpo.observe.TidalObserver`), the metrics ``train_step`` returns (``time/<phase>``,
``response/length_mean``, ...), ``trainer.colocation.engine.stats`` (the native engine's step counts
and host timers) and ``trainer.colocation.engine.memory_report()``. Natural lengths go through
``trainer.maker.completion_budget``: each sequence's drawn length is its budget, and the sequence
ends with EOS there (budget forcing: ``finish_reason`` ``stop``, EOS included), with
``rollout.ignore_eos`` so that no sequence ends earlier. A long-tail case (``carry``, ``drop``) sets
``rollout.partial.mode`` (``carry`` with ``algorithm.mismatch.mode: token_truncate``, which it
requires; the default ``oversample``); its rollouts draw budgets for the sequences they start. A
distillation case (``Workload.teacher``) adds ``model.teacher.path`` (the teacher folder the setup
built) and ``algorithm.distill_coef: 1`` with ``distill_task_weight: 0`` (the teacher's signal
alone; the rewards are still computed); where the teacher waits between uses is Tidal's default
(``strategy.offload_teacher``).
"""

from __future__ import annotations

import math
import statistics
import time

from bench.grpo.procs import Sink, first_error
from bench.grpo.settings import RunSettings
from bench.grpo.workloads import Workload

KL_COEF = 0.04
DISTILL_COEF = 1.0
DISTILL_TASK_WEIGHT = 0.0
REWARD_PATH = "bench.grpo.rewards:tidal_reward"


def tidal_config(spec: dict) -> dict:
    """The Tidal run config of a case, before the case's ``tidal_set`` overrides."""
    w, s = Workload(**spec["workload"]), RunSettings(**spec["settings"])
    cfg = {
        # one more when profiling: the profiled iteration comes after the timed ones
        "run": {"output_dir": spec["run_dir"], "steps": s.tidal_warmup + s.tidal_steps + int(bool(spec.get("profile"))),
                "seed": s.seed, "device": "cuda" if spec["device"] == "cuda" else "cpu"},
        "model": {"path": spec["model_dir"], "tokenizer_path": spec["tokenizer_dir"]},
        "data": {"train": [{"path": spec["data"]}], "apply_chat_template": False, "max_prompt_len": w.prompt_len},
        # natural lengths end by budget forcing (see the module docstring), so EOS is ignored in both modes
        "rollout": {"prompts_per_step": w.prompts, "n_samples": w.samples, "max_new_tokens": w.max_new_tokens,
                    "ignore_eos": True, "temperature": 1.0},
        "optim": {"lr": s.lr, "max_grad_norm": 1.0},
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token_mean",
                      "kl_coef": KL_COEF if w.kl else 0.0, "kl_estimator": "k3"},
        "reward": {"components": {"score": {"type": "function", "path": REWARD_PATH}},
                   "recipes": {"default": [["score", 1.0]]}, "default_recipe": "default"},
        "eval": {"at_start": False, "at_end": False, "every": 0},
        "checkpoint": {"every": 0, "at_end": False, "resume": "never"},
        "logging": {"backends": []},
    }
    if w.partial_rollout:
        cfg["rollout"]["partial"] = {"mode": w.rollout}
    if w.rollout == "carry":
        cfg["algorithm"]["mismatch"] = {"mode": "token_truncate"}
    if w.teacher:
        cfg["model"]["teacher"] = {"path": spec["teacher_dir"]}
        cfg["algorithm"].update(distill_coef=DISTILL_COEF, distill_task_weight=DISTILL_TASK_WEIGHT)
    return cfg


class DrawnLengths:
    """The ``lengths`` of a :class:`tidal.trainer.budget.CompletionBudget`: rollout k (the k-th call)
    gets ``workload.completion_lengths(k, seed)``, the same draws the TRL runner uses (a long-tail
    rollout: as many draws as sequences it starts)."""

    def __init__(self, workload: Workload, seed: int):
        self.workload, self.seed, self.calls = workload, seed, 0

    def __call__(self, items, params) -> list[int]:
        self.calls += 1
        return self.workload.completion_lengths(self.calls - 1, self.seed, count=len(items) * params.n)


def predicted_peak_gib(trainer) -> float | None:
    """The memory plan's predicted peak allocated GiB (issue 21), or None while the trainer has no
    plan: it is read from ``trainer.memory.plan.predicted_peak_allocated_gib``, the name the memory
    plan (``tidal/memory/plan.py``) gives it, as soon as the trainer carries one."""
    plan = getattr(getattr(trainer, "memory", None), "plan", None)
    return None if plan is None else float(plan.predicted_peak_allocated_gib)


def worker_tidal(spec: dict, sink: Sink) -> None:
    """Build Tidal's trainer from the case config and time ``train_step`` iterations until done or the deadline."""
    import torch

    from bench.grpo.observe import TidalObserver
    from bench.grpo.profile import profile_iteration
    from tidal.build import build_trainer
    from tidal.config import TidalConfig
    from tidal.config_base import apply_overrides, build
    from tidal.trainer.budget import CompletionBudget

    cuda = spec["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    w, s = Workload(**spec["workload"]), RunSettings(**spec["settings"])
    cfg = build(TidalConfig, apply_overrides(tidal_config(spec), spec["tidal_set"]))
    t0 = time.perf_counter()
    trainer = build_trainer(cfg)
    init_s = time.perf_counter() - t0
    obs = TidalObserver(trainer.colocation.peaks)
    trainer.timer.add_observer(obs)
    setup_peak, setup_reserved = obs.peaks_so_far()
    if w.lengths == "natural":
        trainer.maker.completion_budget = CompletionBudget(lengths=DrawnLengths(w, s.seed),
                                                           end_token_id=trainer.models.tokenizer.eos_token_id)
    data = trainer.data.train
    sink.write({"kind": "init", "init_s": init_s, "prompt_lens": sorted({len(data[i].prompt_ids) for i in range(len(data))}),
                "peak_allocated": setup_peak, "peak_reserved": setup_reserved, "config": cfg.to_dict(),
                "engine_memory": trainer.colocation.engine.memory_report(), "predicted_peak_gib": predicted_peak_gib(trainer)})
    total = s.tidal_warmup + s.tidal_steps
    last = _loop(trainer, obs, w, s, spec["deadline"], cuda, sink)
    if spec.get("profile"):
        profile_iteration(trainer, obs, total + 1, cuda, spec["profile"], sink, spec["deadline"], last)


def _loop(trainer, obs, w: Workload, s: RunSettings, deadline: float, cuda: bool, sink: Sink) -> float:
    """Time the warm-up and timed iterations (one "step" record each); returns the last one's seconds."""
    import torch

    last = 0.0
    for step in range(1, s.tidal_warmup + s.tidal_steps + 1):
        # the first iterations compile and warm up: they predict nothing about the next
        if step > s.tidal_warmup + 1 and time.time() + 1.3 * last > deadline:
            sink.write({"kind": "stopped", "reason": "deadline", "after_step": step - 1})
            return last
        obs.mark("iteration:start")
        engine = trainer.colocation.engine
        engine_before = dict(getattr(engine, "stats", {}))
        n_rollouts = len(obs.rollouts)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
        last = time.perf_counter() - t0
        obs.mark("iteration:end")
        points, calls = obs.pop()
        rollouts = obs.rollouts[n_rollouts:]
        sink.write({
            "kind": "step", "step": step, "wall_s": last, "metrics": {k: float(v) for k, v in metrics.items()},
            "peak_allocated": _max(p.get("peak") for p in points), "peak_reserved": _max(p.get("peak_reserved") for p in points),
            "timeline": points, "calls": calls, "rollout": rollouts[-1] if rollouts else None, "rollouts": len(rollouts),
            # rollout k's lengths (forced or drawn); a long-tail rollout trains sequences of several rollouts
            "expected_lengths": None if w.partial_rollout else w.completion_lengths(n_rollouts, s.seed),
            "engine": {k: v - engine_before.get(k, 0) for k, v in getattr(engine, "stats", {}).items()
                       if isinstance(v, (int, float))},
        })
    return last


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


# ---- summary (parent side) ---------------------------------------------------------------------------
def split_steps(steps: list[dict], warmup: int) -> tuple[list[dict], list[dict]]:
    steps = sorted(steps, key=lambda r: r["step"])
    return steps[:warmup], steps[warmup:]


def experts_touched(engine: dict) -> float | None:
    """An MoE run's distinct experts per decode step, summed over the MoE layers (the native engine's
    ``moe_experts_touched`` over ``moe_decode_steps`` in one iteration); None for a dense model."""
    steps = engine.get("moe_decode_steps", 0)
    return engine["moe_experts_touched"] / steps if steps else None


def tidal_checks(init: dict, steps: list[dict], w: Workload) -> dict[str, bool]:
    """Each iteration ran the workload it claims: prompt length, one rollout of ``seqs`` completions
    with the expected lengths (forced: all ``max_new_tokens``, ``length``; natural: the draws, each
    ending ``stop`` with the forced EOS), the length metric, finite rewards, no skipped step, a
    reference model if and only if KL is on, a teacher's signal (``distill/reverse_kl``, finite) and
    forward (``time/teacher_logprobs``) if and only if the case distils. A long-tail rollout trains
    ``seqs`` completions whose lengths come from several rollouts' draws: each within
    ``1..max_new_tokens``, the length metric their mean, and its ``partial/*`` metrics reported."""
    rollouts = [r.get("rollout") or {} for r in steps]
    end = "stop" if w.lengths == "natural" else "length"
    if w.partial_rollout:
        steps = [{**r, "expected_lengths": ro.get("lengths") or [0]} for r, ro in zip(steps, rollouts)]
    return {
        "prompt_len": init.get("prompt_lens") == [w.prompt_len],
        "completions_per_rollout": bool(steps) and all(r.get("rollouts") == 1 and len(ro.get("lengths", [])) == w.seqs
                                                       for r, ro in zip(steps, rollouts)),
        "completion_lengths": bool(steps) and all(
            all(1 <= x <= w.max_new_tokens for x in ro.get("lengths") or [0]) if w.partial_rollout else ro.get("lengths") == r["expected_lengths"]
            for r, ro in zip(steps, rollouts)),
        f"finish_{end}": bool(steps) and all(ro.get("finish_reasons") and set(ro["finish_reasons"]) == {end} for ro in rollouts),
        "response_length_metric": bool(steps) and all(
            math.isclose(r["metrics"].get("response/length_mean", -1.0), statistics.mean(r["expected_lengths"]), rel_tol=1e-4)
            for r in steps),
        "finite_rewards": bool(steps) and all(math.isfinite(r["metrics"].get("reward/mean", math.nan)) for r in steps),
        "one_optimizer_step": bool(steps) and all(r["metrics"].get("actor/skipped", 0.0) == 0.0 for r in steps),
        "reference_model_iff_kl": bool(steps) and all(("actor/kl" in r["metrics"]) == w.kl for r in steps),
        "partial_metrics_iff_partial": bool(steps) and all(("partial/new_groups" in r["metrics"]) == w.partial_rollout for r in steps),
        "teacher_iff_distill": bool(steps) and all(
            ("distill/reverse_kl" in r["metrics"]) == ("time/teacher_logprobs" in r["metrics"]) == bool(w.teacher)
            and math.isfinite(r["metrics"].get("distill/reverse_kl", 0.0)) for r in steps),
    }


def summarize_tidal(records: list[dict], w: Workload, s: RunSettings) -> dict:
    """Aggregate a Tidal worker's records: steady iterations, phase medians, peaks, timeline, checks."""
    init = next((r for r in records if r["kind"] == "init"), {})
    warm, steady = split_steps([r for r in records if r["kind"] == "step"], s.tidal_warmup)
    all_steps = warm + steady
    names = sorted({k[5:] for r in steady for k in r["metrics"] if k.startswith("time/") and k != "time/step"})
    syncs = [c for r in steady for c in r["calls"] if c["name"].startswith("update_engine_weights")]
    last = steady[-1] if steady else (warm[-1] if warm else None)
    return {
        "error": first_error(records), "init_s": init.get("init_s"),
        "warmup_s": [r["wall_s"] for r in warm], "steady_s": [r["wall_s"] for r in steady],
        "steps_s": [r["wall_s"] for r in all_steps],
        "first_iteration_s": all_steps[0]["wall_s"] if all_steps else None,
        "phases": {p: statistics.median([r["metrics"].get(f"time/{p}", 0.0) for r in steady]) for p in names},
        "phases_per_step": [{k[5:]: v for k, v in r["metrics"].items() if k.startswith("time/")} for r in steady],
        "lengths_per_step": [(r.get("rollout") or {}).get("lengths") or r["expected_lengths"] or [] for r in steady],
        "experts_touched_per_step": [experts_touched(r.get("engine") or {}) for r in steady],
        "partial": {k: statistics.median([r["metrics"].get(k, 0.0) for r in steady])
                    for k in sorted({k for r in steady for k in r["metrics"] if k.startswith("partial/")})} or None,
        "checks": tidal_checks(init, all_steps, w),
        "stopped_early": any(r["kind"] == "stopped" for r in records),
        "peak_allocated": _max([init.get("peak_allocated")] + [r["peak_allocated"] for r in all_steps]),
        "peak_reserved": _max([init.get("peak_reserved")] + [r["peak_reserved"] for r in all_steps]),
        "predicted_peak_gib": init.get("predicted_peak_gib"),
        "mismatch": mismatch_of(all_steps),
        "weight_sync": {"bytes": syncs[-1]["returned"] if syncs else None, "seconds": [c["seconds"] for c in syncs]},
        "engine_host": engine_host_ms(steady),
        "timeline": last["timeline"] if last else [], "timeline_calls": last["calls"] if last else [],
        "timeline_step": last["step"] if last else None,
        "profile": _profile_of(records),
    }


def mismatch_of(steps: list[dict]) -> dict | None:
    """The engine-versus-trainer logprob mismatch of every iteration (warm-up included: the first
    one's weights are those the engine sampled with): per step the mean and max absolute difference
    (``mismatch/abs_logp_diff_mean``, ``mismatch/logp_diff_max``); None when the run logged none."""
    rows = [(r["metrics"].get("mismatch/abs_logp_diff_mean"), r["metrics"].get("mismatch/logp_diff_max")) for r in steps]
    rows = [(m, x) for m, x in rows if m is not None]
    if not rows:
        return None
    return {"abs_logp_diff_mean": [m for m, _ in rows], "logp_diff_max": [x for _, x in rows]}


HOST_TIMERS = ("schedule", "postprocess", "prepare", "submit")  # the native engine's host work (``wait``: blocked on the device)


def engine_host_ms(steps: list[dict]) -> dict | None:
    """Median over ``steps`` of the native engine's host milliseconds per engine step (prefill and
    decode) for each of its host timers (schedule, postprocess, prepare, submit, wait), from the
    engine's cumulative ``stats``; ``host`` is their sum without ``wait`` (host work the device waits
    for unless it overlaps a step in flight), ``device`` the engine's own device timer when its
    stats have one (``device_s``); ``engine_steps`` and ``decode_steps`` are counts per iteration,
    ``ahead_frac`` the decode steps scheduled ahead over all decode steps. None
    for an engine without timers."""
    per_step: dict[str, list[float]] = {}
    for r in steps:
        e = r.get("engine") or {}
        n = e.get("decode_steps", 0) + e.get("prefill_steps", 0)
        if not n:
            continue
        for k, v in e.items():
            if k.endswith("_s"):
                per_step.setdefault(k[:-2], []).append(1e3 * v / n)
        if any(f"{t}_s" in e for t in HOST_TIMERS):
            per_step.setdefault("host", []).append(1e3 * sum(e.get(f"{t}_s", 0.0) for t in HOST_TIMERS) / n)
        per_step.setdefault("engine_steps", []).append(n)
        per_step.setdefault("decode_steps", []).append(e.get("decode_steps", 0))
        if "ahead_decode_steps" in e:  # decode steps scheduled ahead (host work hidden) over all decode steps
            per_step.setdefault("ahead_frac", []).append(e["ahead_decode_steps"] / max(1, e.get("decode_steps", 0)))
    return {k: round(statistics.median(v), 4) for k, v in per_step.items()} or None


def _profile_of(records: list[dict]) -> dict | None:
    """The profiled iteration's record (with its trace's, if any), or None when none was profiled."""
    prof = next((r for r in records if r["kind"] == "profile"), None)
    trace = next((r for r in records if r["kind"] == "profile_trace"), None)
    if prof is None:
        return None
    prof = {k: v for k, v in prof.items() if k != "kind"}
    if trace is not None:
        prof["trace"] = {k: v for k, v in trace.items() if k != "kind"}
    return prof
