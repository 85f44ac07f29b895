"""Console backend: a rich progress bar over the run's steps and a compact table per logged step."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from tidal.logging.backends import BACKENDS
from tidal.logging.config import LoggingConfig


def group_metrics(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{"reward/mean": 1, "loss": 2}`` -> ``{"reward": {"mean": 1}, "other": {"loss": 2}}`` (key order kept)."""
    groups: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        prefix, _, rest = key.partition("/")
        group, name = (prefix, rest) if rest else ("other", key)
        groups.setdefault(group, {})[name] = value
    return groups


def format_value(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"


def step_table(step: int, total_steps: int, metrics: dict[str, float]) -> Table:
    """One row per key prefix: ``reward | mean 0.51  std 0.12``."""
    table = Table(title=f"step {step}/{total_steps}", title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for group, values in group_metrics(metrics).items():
        table.add_row(group, "  ".join(f"{name} [bold]{format_value(v)}[/]" for name, v in values.items()))
    return table


@BACKENDS.register("console")
class ConsoleBackend:
    """Progress bar (steps done / total, elapsed, remaining) with each logged step's table printed above it."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, *, total_steps: int, start_step: int, hparams: dict | None, console: Console | None = None):
        self.total_steps = total_steps
        self.console = console or Console()
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step)
        self._progress.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._progress.console.print(step_table(step, self.total_steps, metrics))
        self._progress.update(self._task, completed=step)

    def close(self) -> None:
        self._progress.stop()
