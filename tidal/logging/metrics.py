"""MetricsLogger: the one object the trainer hands step metrics to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tidal.logging import console as _console  # noqa: F401  (registers the console backend)
from tidal.logging.backends import make_backend, require_package
from tidal.logging.config import LoggingConfig
from tidal.logging.reduce import combine_steps
from tidal.logging.timer import PhaseObserver


def _to_float(key: str, value: Any) -> float:
    if hasattr(value, "item"):  # 0-d tensors / numpy scalars
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return float(value)
    raise TypeError(f"metric '{key}' must be a number, got {type(value).__name__}")


class MetricsLogger:
    """Sends step metrics to the configured backends (main rank only).

    ``log(step, metrics)`` takes 1-based steps in increasing order and values already reduced over
    ranks. With ``log_every = N`` the backends are written at steps divisible by N and at
    ``total_steps``; each written value combines that key over the steps since the previous write
    (:func:`tidal.logging.reduce.combine_steps`: the max of ``*_max``, the min of ``*_min``, else the
    mean; keys logged on one step only, such as eval/*, pass through unchanged). ``start_step`` is
    the last step completed before this process started (resume): backends discard what they had
    recorded after it, and the progress bar starts there. ``hparams`` (the run config as a dict) is
    given to W&B and TensorBoard. On other ranks every call is a no-op, but a missing backend package
    (tensorboard, wandb) still raises a ConfigError at construction on every rank.
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        *,
        is_main: bool,
        total_steps: int,
        start_step: int = 0,
        hparams: dict | None = None,
    ):
        for name in cfg.backends:  # on every rank: all fail alike, before anything is written
            require_package(name)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.total_steps = total_steps
        self._last_step = start_step
        self._window: dict[str, list[float]] = {}
        self._backends = []
        if is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            kwargs = dict(total_steps=total_steps, start_step=start_step, hparams=hparams)
            self._backends = [make_backend(name, cfg, self.run_dir, **kwargs) for name in cfg.backends]

    def rewind(self, start_step: int) -> None:
        """Continue from ``start_step`` after all (a resume fell back to an older checkpoint than the
        one this logger was started for): the JSONL record drops what it had after it. TensorBoard
        and W&B purge only when they start; their later points are overwritten as steps repeat."""
        from tidal.files import open_regular
        from tidal.logging.backends import JsonlBackend, _truncate_after

        self._last_step = start_step
        for backend in self._backends:
            if isinstance(backend, JsonlBackend):
                backend._f.close()
                _truncate_after(backend.path, start_step)
                backend._f = open_regular(backend.path, "a", what="metrics file", encoding="utf-8")

    def observers(self) -> list[PhaseObserver]:
        """The backends that watch the phases of a step (the console's step bar), for
        :meth:`PhaseTimer.add_observer`; none on ranks other than the main one."""
        return [b for b in self._backends if isinstance(b, PhaseObserver)]

    def log_start(self, metrics: dict[str, Any]) -> None:
        """Record ``metrics`` of the start of the run (the evaluation before step 1) as step 0,
        written at once by every backend. Only before any step is logged (a fresh run)."""
        if self._last_step != 0 or self._window:
            raise ValueError(f"the start of the run is step 0, but step {self._last_step} was logged already")
        if self.is_main:
            values = {k: _to_float(k, v) for k, v in metrics.items()}
            for backend in self._backends:
                backend.write(0, values)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if step <= self._last_step:
            raise ValueError(f"step {step} logged after step {self._last_step}; steps must increase")
        self._last_step = step
        if not self.is_main:
            return
        for key, value in metrics.items():
            self._window.setdefault(key, []).append(_to_float(key, value))
        if step % self.cfg.log_every == 0 or step >= self.total_steps:
            self._flush(step)

    def _flush(self, step: int) -> None:
        if not self._window:
            return
        values = {k: combine_steps(k, v) for k, v in self._window.items()}
        self._window = {}
        for backend in self._backends:
            backend.write(step, values)

    def close(self) -> None:
        """Write any pending window at the last logged step, then close every backend."""
        if self.is_main:
            self._flush(self._last_step)
        for backend in self._backends:
            backend.close()
        self._backends = []
