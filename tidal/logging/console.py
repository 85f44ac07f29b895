"""Console backend: one compact line per logged step, a full table every ``logging.table_every``
steps, and the run's step bar (on a terminal).

The line reads, for example::

    step 12/100  reward 0.512  eval acc 0.63  kl 0.0012  4.2k tok/s  1.84 s/step (generate 0.91, train 0.62, weight_sync 0.12, reward 0.08)  about 2 min 49 s left

``reward`` is ``reward/mean``, the reward trained on (reward components and an environment's
outcome reward together; else ``reward/total``, the components' share alone, over valid samples);
``eval acc`` is ``eval/greedy_accuracy`` on the steps that evaluate (``eval reward``,
``eval/greedy_reward``, when the rewards include a reward model and evaluation reports no accuracy);
``kl`` is ``actor/kl`` (else ``kl/rollout``); on CUDA the line ends with the device memory by part
(:func:`memory_text`); the time left is the wall time per step since the first logged step
(evaluations and saves included; at the first, its ``time/step``) times the steps left; tokens per
second are the
tokens generated on all ranks (``response/tokens_count``) over the generate phase
(``time/generate``); the phases are the largest ``time/*`` entries. The table lists every metric by
group under its full name, which says how ranks were combined (:mod:`tidal.logging.reduce`).
Numbers are written for people (:func:`format_value`): counts as integers with thousands
separators, large values with k/M suffixes, three significant digits otherwise.

On a terminal the step bar is a task of the shared live display (:mod:`tidal.logging.progress`),
and the backend is also a :class:`~tidal.logging.timer.PhaseObserver` that shows the phase a
step is in and, after each generation, the sequences and tokens per second generated.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from rich.console import Console

from tidal.logging.backends import BACKENDS
from tidal.logging.config import LoggingConfig
from tidal.logging.progress import display, format_seconds
from tidal.logging.reduce import is_count
from tidal.logging.timer import PhaseObserver

PHASES_SHOWN = 4


def group_metrics(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{"reward/mean": 1, "loss": 2}`` -> ``{"reward": {"mean": 1}, "other": {"loss": 2}}`` (key order kept)."""
    groups: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        prefix, _, rest = key.partition("/")
        group, name = (prefix, rest) if rest else ("other", key)
        groups.setdefault(group, {})[name] = value
    return groups


def format_number(value: float) -> str:
    """A number for people: ``0.512``, ``0.00123``, ``12.3``, ``512``, ``12.3k``, ``1.2M``, ``–`` for NaN."""
    if math.isnan(value):
        return "–"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    a = abs(value)
    if a >= 1e9:
        return f"{value / 1e9:.3g}G"
    if a >= 1e6:
        return f"{value / 1e6:.3g}M"
    if a >= 1e4:
        return f"{value / 1e3:.3g}k"
    if a >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.3g}"


def format_value(key: str, value: float) -> str:
    """``value`` of metric ``key`` for people: a count as an integer with thousands separators
    (``1,024``), seconds with their unit, anything else by :func:`format_number`."""
    if math.isfinite(value) and is_count(key) and value == int(value):
        return f"{int(value):,}"
    if key.startswith("time/") and math.isfinite(value):
        return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"
    return format_number(value)


def tokens_per_s(metrics: dict[str, float]) -> float | None:
    tokens, seconds = metrics.get("response/tokens_count"), metrics.get("time/generate")
    if tokens is None or not seconds:
        return None
    return tokens / seconds


def step_line(step: int, total_steps: int, metrics: dict[str, float], remaining_s: float | None = None) -> str:
    """The compact line of one logged step (see the module docstring); ``remaining_s``: the run's
    estimated time left."""
    parts = [f"step {step}/{total_steps}"]
    shown = (("reward", ("reward/mean", "reward/total")), ("eval acc", ("eval/greedy_accuracy",)),
             ("eval reward", () if "eval/greedy_accuracy" in metrics else ("eval/greedy_reward",)),  # a reward model: no accuracy
             ("kl", ("actor/kl", "kl/rollout")))
    for label, keys in shown:
        key = next((k for k in keys if k in metrics), None)
        if key is not None:
            parts.append(f"{label} {format_number(metrics[key])}")
    rate = tokens_per_s(metrics)
    if rate is not None:
        parts.append(f"{format_number(rate)} tok/s")
    phases = sorted(((k[5:], v) for k, v in metrics.items() if k.startswith("time/") and k != "time/step"),
                    key=lambda kv: -kv[1])
    if "time/step" in metrics:
        shown = ", ".join(f"{name} {v:.2f}" for name, v in phases[:PHASES_SHOWN])
        parts.append(f"{metrics['time/step']:.2f} s/step" + (f" ({shown})" if shown else ""))
    if remaining_s is not None and step < total_steps:
        parts.append(f"about {format_seconds(remaining_s)} left")
    memory = memory_text(metrics)
    if memory:
        parts.append(memory)
    return "  ".join(parts)


# (label, metric name after ``memory/`` and before ``_gib``, how the trained models' values combine)
MEMORY_PARTS = (("peak alloc", "peak_allocated", None), ("weights", "weights", sum), ("optimizer", "optimizer", sum),
                ("activations peak", "activations_peak", max), ("engine weights", "engine_weights", None),
                ("KV cache", "engine_kv_cache", None), ("graphs", "engine_graphs", None))
TRAINED = ("actor", "critic")


def memory_text(metrics: dict[str, float]) -> str:
    """``mem 115.2 GiB on the device (peak alloc 40.1, weights 2.8, optimizer 3.7, activations peak 12.0,
    engine weights 0.9, KV cache 70.3, graphs 0.4)``: what the device holds (``memory/device_used_gib``,
    the KV cache outside PyTorch's allocator included) and its known parts
    (:mod:`tidal.logging.memory_parts`): the trained models' weights and optimizer state summed, the
    largest of their update peaks; empty off CUDA."""
    if "memory/device_used_gib" not in metrics:
        return ""
    shown = []
    for label, name, combine in MEMORY_PARTS:
        keys = [f"memory/{role}_{name}_gib" for role in TRAINED] if combine else [f"memory/{name}_gib"]
        values = [metrics[k] for k in keys if k in metrics]
        if values:
            shown.append(f"{label} {(combine or sum)(values):.1f}")
    return f"mem {metrics['memory/device_used_gib']:.1f} GiB on the device" + (f" ({', '.join(shown)})" if shown else "")


def step_table(step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """Every metric, one line per key prefix (``reward     total 0.512  total/count 128  dropped_count 0``),
    as plain text: nothing wraps or pads it in a log file."""
    groups = group_metrics(metrics)
    width = max((len(g) for g in groups), default=0)
    lines = [f"step {step}/{total_steps}: all metrics"]
    for group, values in groups.items():
        prefix = "" if group == "other" else f"{group}/"
        lines.append(f"  {group:<{width}}  " + "  ".join(f"{name} {format_value(prefix + name, v)}" for name, v in values.items()))
    return "\n".join(lines)


@BACKENDS.register("console")
class ConsoleBackend(PhaseObserver):
    """The compact line of each logged step, the full table every ``cfg.table_every`` steps (and at
    the last), and on a terminal a step bar that also shows the current phase."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, *, total_steps: int, start_step: int, hparams: dict | None,
                 console: Console | None = None):
        self.cfg = cfg
        self.total_steps = total_steps
        self._display = display(console)
        self._task = self._display.add("train", total=total_steps, completed=start_step)
        self._generate_s = 0.0
        self._first: tuple[int, float] | None = None  # (step, monotonic time) of the first logged step

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._display.print(step_line(step, self.total_steps, metrics, self.remaining_s(step, metrics)))
        every = self.cfg.table_every
        if step > 0 and every and (step % every == 0 or step >= self.total_steps):
            self._display.print(step_table(step, self.total_steps, metrics))
        self._display.update(self._task, completed=step, info="")

    def remaining_s(self, step: int, metrics: dict[str, float]) -> float | None:
        """The run's time left after ``step``: the wall time per step since the first logged step
        times the steps left (at the first, its ``time/step``); None when unknown."""
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        first_step, t0 = self._first
        per_step = (now - t0) / (step - first_step) if step > first_step else metrics.get("time/step")
        return None if per_step is None else per_step * max(self.total_steps - step, 0)

    def close(self) -> None:
        self._display.remove(self._task)
        self._task = None

    # ---- PhaseObserver: what the step bar says while a step runs ------------------------------------
    def phase_begin(self, name: str) -> None:
        self._display.update(self._task, info=name)

    def phase_end(self, name: str, seconds: float) -> None:
        if name == "generate":
            self._generate_s = seconds

    def event(self, name: str, info: dict | None = None) -> None:
        if name == "generate:done" and info and self._generate_s > 0:
            tokens = sum(info.get("completion_lengths", []))
            self._display.update(self._task, info=f"generated {len(info.get('completion_lengths', []))} sequences, "
                                                  f"{format_number(tokens / self._generate_s)} tok/s (this rank)")
