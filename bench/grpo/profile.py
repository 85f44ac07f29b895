"""One profiled Tidal iteration (``--profile DIR``), summarised per phase.

After the timed iterations of the profiled case, ONE more iteration runs under
``torch.profiler.profile`` (CPU + CUDA activities on CUDA, CPU only otherwise); it is in neither the
medians nor the memory timeline. Each phase the PhaseTimer times becomes a
``record_function("phase/<name>")`` range, opened and closed by a :class:`tidal.logging.PhaseObserver`
(inside the timer's CUDA syncs); ``iteration`` is the whole ``train_step``. Events are assigned to
ranges by time, not by the profiler's schedule (see :func:`analyze_profile`). DIR receives
``phases.txt`` (per range, ``key_averages()`` of exactly its events), ``summary.json`` (per range:
wall, device-kernel and busy seconds, idle fraction, launches, host syncs, top kernels and host
ops) and ``trace.json.gz`` (kept only up to ``--profile-trace-mb``).
"""

from __future__ import annotations

import json
import os
import statistics
import time

from bench.grpo.procs import Sink

PHASE_RANGE = "phase/"  # record_function name of a phase's range: "phase/<name>"
ITERATION_RANGE = "iteration"  # the whole profiled train_step (a pseudo-phase in the outputs)
PROFILE_EXTRA_S = 120  # added to the profiled case's cap: one iteration under the profiler plus post-processing
TRACE_MAX_MB = 15.0  # default --profile-trace-mb (the device machine returns files of at most 16 MiB)
SYNC_CALLS = ("cudaMemcpy", "cudaMemcpy2D", "cuMemcpyDtoH", "cuMemcpyDtoH_v2")  # blocking, besides "*Synchronize*"


def profile_iteration(trainer, rec, step: int, cuda: bool, prof_spec: dict, sink: Sink,
                      deadline: float, last_s: float) -> None:
    """Run iteration ``step`` (after every timed one, so it neither changes their timings nor enters the
    medians) under ``torch.profiler.profile`` and write phases.txt, summary.json and trace.json.gz into
    ``prof_spec["dir"]``; one "profile" record (and a "profile_trace" one) goes to the sink.

    Each phase's range comes from the PhaseTimer's observer hook: for this iteration only, an observer
    opens ``record_function("phase/<name>")`` at each phase's begin and closes it at its end, inside the
    PhaseTimer's own CUDA syncs, so every kernel launched in a phase also finishes inside its range.
    See :func:`analyze_profile` for how events are assigned to ranges. Any failure is reported in
    the record instead of failing the case (its timed iterations are already written).
    """
    import contextlib
    import torch

    need = 3.0 * last_s + 45.0  # the iteration under the profiler, then post-processing
    if time.time() + need > deadline:
        sink.write({"kind": "profile", "error": f"skipped: {deadline - time.time():.0f} s left before the deadline, "
                                                f"needs about {need:.0f} s"})
        return
    try:
        from torch.profiler import ProfilerActivity, profile, record_function

        from tidal.logging import PhaseObserver

        out_dir = prof_spec["dir"]
        os.makedirs(out_dir, exist_ok=True)
        timer = trainer.timer

        class Ranges(PhaseObserver):
            def __init__(self):
                self.open: list[contextlib.AbstractContextManager] = []

            def phase_begin(self, name):
                self.open.append(record_function(PHASE_RANGE + name))
                self.open[-1].__enter__()

            def phase_end(self, name, seconds):
                self.open.pop().__exit__(None, None, None)

        ranges = Ranges()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        timer.add_observer(ranges)
        try:
            with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False) as prof:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with record_function(ITERATION_RANGE):
                    metrics = trainer.train_step(step)
                    if cuda:
                        torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            t1 = time.perf_counter()
            events = prof.events()
        finally:
            timer.remove_observer(ranges)
            rec.pop()  # this iteration's memory points are not the reported timeline
        summary, text = analyze_profile(events, cuda=cuda)
        summary.update(step=step, device="cuda" if cuda else "cpu", iteration_wall_s=wall, postprocess_s=time.perf_counter() - t1)
        timer_s = {k[5:]: float(v) for k, v in metrics.items() if k.startswith("time/") and k != "time/step"}
        for name, ph in summary["phases"].items():
            ph["timer_s"] = wall if name == ITERATION_RANGE else timer_s.get(name)
        with open(os.path.join(out_dir, "phases.txt"), "w") as f:
            f.write(text)
        _write_json(os.path.join(out_dir, "summary.json"), summary)
        sink.write({"kind": "profile", "dir": out_dir, "files": ["phases.txt", "summary.json"], **summary})
    except Exception as e:
        import traceback

        sink.write({"kind": "profile", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        return
    trace = _export_trace(prof, out_dir, prof_spec.get("trace_max_mb", TRACE_MAX_MB), len(events), deadline)
    summary["trace"] = trace
    _write_json(os.path.join(out_dir, "summary.json"), summary)
    sink.write({"kind": "profile_trace", **trace})


def _export_trace(prof, out_dir: str, max_mb: float, n_events: int, deadline: float) -> dict:
    """trace.json.gz if it fits in ``max_mb`` (else deleted) and there is time for it; says which."""
    path = os.path.join(out_dir, "trace.json.gz")
    if max_mb <= 0:
        return {"kept": False, "reason": "--profile-trace-mb 0"}
    need = 30.0 + 50e-6 * n_events
    if time.time() + need > deadline:
        return {"kept": False, "reason": f"no time: {deadline - time.time():.0f} s left, about {need:.0f} s needed"}
    try:
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)
        size = os.path.getsize(path)
    except Exception as e:
        return {"kept": False, "reason": f"export failed: {type(e).__name__}: {e}"}
    out = {"bytes": size, "export_s": time.perf_counter() - t0}
    if size > max_mb * 2**20:
        os.remove(path)
        return {**out, "kept": False, "reason": f"{size / 2**20:.1f} MiB > --profile-trace-mb {max_mb:g}: deleted"}
    return {**out, "kept": True, "file": "trace.json.gz"}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def _interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def _is_copy(name: str) -> bool:
    return name.startswith("Memcpy") or name.startswith("Memset")


def analyze_profile(events, *, cuda: bool, top: int = 25) -> tuple[dict, str]:
    """Per-phase figures and tables from one profiled iteration's ``prof.events()``.

    Ranges: the CPU events named ``phase/<name>`` (a phase entered twice has two) and ``iteration``.
    A host event (op, runtime call, range) belongs to a range when it starts inside it, on any thread
    (autograd runs the backward on its own thread). A device event (kernel, memcpy, memset) belongs to
    the range in which it was *launched*: it is matched to its runtime call (``cudaLaunchKernel``,
    ``cuLaunchKernel``, ``cudaGraphLaunch``, ``cudaMemcpyAsync``...) by CUPTI correlation id, and only
    when no runtime call matches is its own start time used (``kernels_matched_by`` counts both).
    Since each range encloses the PhaseTimer's CUDA syncs, a phase's kernels also run inside it, so
    ``device_busy_s`` (union of its device intervals) over ``wall_s`` gives the idle fraction. The
    tables are ``key_averages()`` of an ``EventList`` of exactly those events (a ``phase/<name>``
    row's self CPU time is Python time outside any op).
    """
    import bisect

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList

    def is_range(e) -> bool:
        return e.name == ITERATION_RANGE or e.name.startswith(PHASE_RANGE)

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    # device side, without the GPU copies of the record_function annotations
    dev = [e for e in events if e.device_type != DeviceType.CPU and not is_range(e)
           and not getattr(e, "is_user_annotation", False)]
    ranges: dict[str, list[tuple[float, float]]] = {}
    for e in sorted((e for e in cpu if is_range(e)), key=lambda e: e.time_range.start):
        key = ITERATION_RANGE if e.name == ITERATION_RANGE else e.name[len(PHASE_RANGE):]
        ranges.setdefault(key, []).append((e.time_range.start, e.time_range.end))
    starts = {k: [s for s, _ in v] for k, v in ranges.items()}

    def inside(key: str, t: float) -> bool:
        i = bisect.bisect_right(starts[key], t) - 1
        return i >= 0 and t <= ranges[key][i][1]

    dev_ids = {e.id for e in dev}
    runtime = {e.id: e for e in cpu if e.name.startswith("cu") and e.id in dev_ids}
    matched = {"launch": 0, "time": 0}
    anchors = []
    for e in dev:
        r = runtime.get(e.id)
        matched["launch" if r is not None else "time"] += 1
        anchors.append(r.time_range.start if r is not None else e.time_range.start)

    phases: dict[str, dict] = {}
    text = [f"Tidal: one profiled iteration, {'CPU + CUDA' if cuda else 'CPU'} activities; per range the events "
            f"inside it (see analyze_profile in bench/grpo/profile.py); times in the tables are the profiler's.\n"]
    for key in ranges:
        host = [e for e in cpu if inside(key, e.time_range.start)]
        mine = [e for e, t in zip(dev, anchors) if inside(key, t)]
        wall_us = sum(b - a for a, b in ranges[key])
        kernels = [e for e in mine if not _is_copy(e.name)]
        copies = [e for e in mine if _is_copy(e.name)]
        calls: dict[str, int] = {}
        for e in host:
            if e.name.startswith("cu"):
                calls[e.name] = calls.get(e.name, 0) + 1
        launch_calls = {n: c for n, c in calls.items() if "Launch" in n}
        sync_calls = {n: c for n, c in calls.items() if "Synchronize" in n or n in SYNC_CALLS}
        by_kernel: dict[str, list] = {}
        for e in kernels:
            slot = by_kernel.setdefault(e.name, [0, 0.0])
            slot[0] += 1
            slot[1] += (e.time_range.end - e.time_range.start) / 1e6
        by_op: dict[str, list] = {}
        for e in host:
            if is_range(e):
                continue
            slot = by_op.setdefault(e.name, [0, 0.0])
            slot[0] += 1
            slot[1] += e.self_cpu_time_total / 1e6
        busy_s = _interval_union([(e.time_range.start, e.time_range.end) for e in mine]) / 1e6
        ph = {
            "entries": len(ranges[key]), "wall_s": wall_us / 1e6, "timer_s": None,
            "host_events": len(host),
            # host time on the range's own thread outside any recorded op: Python, or waiting (e.g. for the autograd thread)
            "range_self_cpu_s": sum(e.self_cpu_time_total for e in host if is_range(e) and (
                e.name == ITERATION_RANGE if key == ITERATION_RANGE else e.name == PHASE_RANGE + key)) / 1e6,
            "top_cpu_ops": [[n, c, t] for n, (c, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:5]],
        }
        if cuda:
            ph.update({
                "device_kernel_s": sum(t for _, t in by_kernel.values()),
                "device_copy_s": sum((e.time_range.end - e.time_range.start) / 1e6 for e in copies),
                "device_busy_s": busy_s,
                "device_idle_frac": max(0.0, 1.0 - busy_s / (wall_us / 1e6)) if wall_us > 0 else None,
                "device_kernels": len(kernels), "device_copies": len(copies),
                "kernel_launches": sum(c for n, c in launch_calls.items() if "Graph" not in n),
                "graph_launches": sum(c for n, c in launch_calls.items() if "Graph" in n),
                "launch_calls": launch_calls,
                "host_syncs": sum(sync_calls.values()), "sync_calls": sync_calls,
                "memcpy_dtoh": sum(1 for e in copies if "DtoH" in e.name),
                "top_kernels": [[n, c, t] for n, (c, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:5]],
            })
        phases[key] = ph
        evl = EventList(host + mine, use_device="cuda" if cuda else None)
        evl._tree_built = True  # a subset of prof.events(), whose parent/child links are already built
        avg = evl.key_averages()
        head = (f"==== {key}: {ph['entries']} entr{'y' if ph['entries'] == 1 else 'ies'}, wall {1e3 * ph['wall_s']:.3f} ms, "
                f"{1e3 * ph['range_self_cpu_s']:.3f} ms of it outside ops on the range's thread")
        if cuda:
            head += (f"; device kernels {1e3 * ph['device_kernel_s']:.3f} ms, busy {1e3 * ph['device_busy_s']:.3f} ms "
                     f"(idle {100 * (ph['device_idle_frac'] or 0):.1f}%), {ph['device_kernels']} kernels, "
                     f"{ph['kernel_launches']} launch calls + {ph['graph_launches']} graph launches, "
                     f"{ph['host_syncs']} host syncs {sync_calls}, {ph['memcpy_dtoh']} DtoH copies")
        text.append(head + "\n")
        sorts = [("self_device_time_total", "self device time"), ("self_cpu_time_total", "self CPU time")] if cuda \
            else [("self_cpu_time_total", "self CPU time")]
        for sort_by, label in sorts:
            text.append(f"-- top {top} by {label} --\n")
            text.append(_avg_table(avg, sort_by, top, cuda) + "\n")
    summary = {
        "method": "record_function range per phase around the PhaseTimer hook; host events by start time, device "
                  "events by the time of their launching runtime call (CUPTI correlation id), else their own start",
        "events": len(events), "device_events": len(dev), "kernels_matched_by": matched,
        "phases": phases,
    }
    if cuda and not dev:
        summary["warning"] = "no device events recorded (CUPTI gave nothing): the device figures are zero"
    return summary, "\n".join(text)


def _avg_table(avg, sort_by: str, top: int, cuda: bool) -> str:
    """The ``top`` rows of ``key_averages()`` by ``sort_by``, in ms. Our own formatting: torch's
    ``EventList.table`` asserts when a subset's total device time is 0 but a row's is not (seen on
    torch 2.11 with a range's subset of events)."""
    cols = [("calls", lambda e: f"{e.count}")]
    if cuda:
        cols += [("self dev ms", lambda e: f"{e.self_device_time_total / 1e3:.3f}"),
                 ("dev ms", lambda e: f"{e.device_time_total / 1e3:.3f}")]
    cols += [("self cpu ms", lambda e: f"{e.self_cpu_time_total / 1e3:.3f}"),
             ("cpu ms", lambda e: f"{e.cpu_time_total / 1e3:.3f}")]
    rows = sorted(avg, key=lambda e: -getattr(e, sort_by))[:top]
    lines = ["  ".join([f"{'name':<100}"] + [f"{c:>12}" for c, _ in cols])]
    for e in rows:
        lines.append("  ".join([f"{e.key[:100]:<100}"] + [f"{f(e):>12}" for _, f in cols]))
    return "\n".join(lines)


def profile_figure(sm: dict, default_dir: str | None) -> dict:
    """The fields of the ``profile`` figure from a Tidal summary ``sm``: per phase of the profiled
    iteration its wall time (and the unprofiled median), device-kernel time, idle fraction,
    launches, host syncs and top kernel; the files written (the full tables are in the folder)."""
    prof = sm["profile"]
    if prof.get("error"):
        return {"dir": prof.get("dir") or default_dir, "error": prof["error"]}
    phases = {}
    for name, ph in prof["phases"].items():
        top = (ph.get("top_kernels") or ph.get("top_cpu_ops") or [None])[0]
        phases[name] = {
            "wall_s": ph["wall_s"], "timer_s": ph.get("timer_s"),
            "unprofiled_median_s": (statistics.median(sm["steady_s"]) if sm["steady_s"] else None)
            if name == ITERATION_RANGE else sm["phases"].get(name),
            "outside_ops_s": ph.get("range_self_cpu_s"),
            **{k: ph.get(k) for k in ("device_kernel_s", "device_idle_frac", "kernel_launches", "graph_launches",
                                      "host_syncs", "memcpy_dtoh") if k in ph},
            "top": [top[0][:80], top[1], top[2]] if top else None,
        }
    trace = prof.get("trace") or {"kept": False, "reason": "not written (worker stopped first)"}
    files = list(prof.get("files", [])) + (["trace.json.gz"] if trace.get("kept") else [])
    return {"dir": prof["dir"], "step": prof.get("step"), "files": files,
            "trace_mib": (trace["bytes"] / 2**20) if trace.get("bytes") else None,
            "trace_note": None if trace.get("kept") else trace.get("reason"),
            "events": prof.get("events"), "device_events": prof.get("device_events"),
            "kernels_matched_by": prof.get("kernels_matched_by"), "warning": prof.get("warning"),
            "postprocess_s": prof.get("postprocess_s"), "phases": phases}
