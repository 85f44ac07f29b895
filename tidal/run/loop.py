"""One job loop: the run's cadence for every job (RL, reward model).

A job (:class:`Job`) knows how to take one step, evaluate, and name its state; :class:`JobLoop`
owns everything around that, once for every job:

- **resume**: the checkpoint chosen at setup loaded through :func:`tidal.run.checkpoint.load_resume`
  (under ``checkpoint.resume: auto`` a checkpoint that fails to load on any rank is skipped for the
  next older one, every rank agreeing; the metrics log is rewound to the step actually loaded);
- **cadence**: evaluation at the start, every ``eval.every`` steps and at the end; checkpoints
  every ``checkpoint.every`` steps and at the end;
- **stop signals**: a SIGINT/SIGTERM on any rank stops every rank after the same step, with a
  checkpoint when checkpoints are enabled (:mod:`tidal.run.stop`, exit code 75);
- **skip accounting**: optimizer steps skipped on a non-finite gradient norm are counted, and
  ``train.max_skipped_steps_in_a_row`` of them in a row stop the run.

It does not know what a step does, which models a job trains, or how they are placed on the device.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

from tidal.config_base import ConfigError
from tidal.data import StatefulDistributedSampler
from tidal.distributed.runtime import Runtime
from tidal.logging import MetricsLogger
from tidal.logging.progress import stage
from tidal.logging.timer import PhaseTimer
from tidal.run import checkpoint as ckpt
from tidal.run.resume import ResumePoint
from tidal.run.stop import StopRequest, StopRun
from tidal.run.watchdog import Watchdog


@dataclasses.dataclass(kw_only=True)
class LoopState:
    """What the loop keeps across steps, saved as ``trainer`` in every checkpoint's trainer.json
    (a job may extend it with fields of its own)."""

    skipped_in_a_row: int = 0
    skipped_total: int = 0
    initial_eval: dict[str, float] = dataclasses.field(default_factory=dict)


class Job(Protocol):
    """What a job hands the loop. ``name``: written as ``job`` into its checkpoints (a resume loads
    only its own job's); ``skip_key``: the step metric that is > 0 when the optimizer step was
    skipped (``<prefix>/skipped``; the loop adds ``<prefix>/skipped_total``); ``skip_hint``: what
    to check when steps keep being skipped; ``logs_initial_eval``: the first evaluation is step 0
    of the metrics (the RL curves start there)."""

    name: str
    skip_key: str
    skip_hint: str
    logs_initial_eval: bool
    state: LoopState
    sampler: StatefulDistributedSampler  # the training data's position, saved and restored by the loop

    def has_eval(self) -> bool:
        """Whether there is anything to evaluate on."""

    def train_step(self, step: int) -> dict[str, float]:
        """One training step (a collective); its metrics, reduced over ranks."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Eval metrics of the current model over all ranks (a collective)."""

    def model_states(self) -> dict[str, Any]:
        """Fresh sharded state dicts of the trained models (DCP-ready), to save or to load into."""

    def job_state(self) -> dict[str, Any]:
        """The job's own entries of trainer.json (algorithm state, ...; a collective allowed)."""

    def load_state(self, states: dict[str, Any], trainer_state: dict[str, Any]) -> None:
        """Take loaded model states and trainer.json (:attr:`state` and the sampler already restored)."""

    def announce(self, when: str, metrics: dict[str, float]) -> None:
        """Print the eval metrics of the start or the end (``when``)."""

    def finish(self) -> None:
        """After the last step, inside the run (an export at the end, ...)."""

    def close(self) -> None:
        """When the run ends, also on error (after the logger and the watchdog are closed)."""


class JobLoop:
    """Runs a :class:`Job` to ``run.steps`` (see the module docstring). ``cfg``: a config with the
    sections ``run``, ``eval``, ``checkpoint`` and ``train``; ``resume``: the checkpoint chosen at
    setup (None for a fresh run); ``required_keys``: what the job's trainer.json must hold."""

    def __init__(self, job: Job, *, cfg, runtime: Runtime, timer: PhaseTimer, watchdog: Watchdog, logger: MetricsLogger,
                 resume: ResumePoint | None, required_keys: tuple[str, ...]):
        self.job = job
        self.cfg = cfg
        self.rt = runtime
        self.timer = timer
        self.watchdog = watchdog
        self.logger = logger
        self.resume_point = resume
        self.required_keys = required_keys
        self.ckpt_root = ckpt.checkpoint_root(cfg.run.output_dir)
        self.loaded_from: str | None = None  # the checkpoint :meth:`resume` loaded

    # ---- resume and save ---------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the resume point (models, optimizer, job and loop state, RNG); returns the step
        loaded, 0 for a fresh run (or when every candidate failed to load under ``auto``). A second
        call is a no-op. The checkpoint's path is kept in :attr:`loaded_from`; the caller says what
        it loaded it for (training, eval, export)."""
        point = self.resume_point
        if point is None:
            return 0
        self._check_job(point)
        which = "auto" if self.cfg.checkpoint.resume == "auto" else str(point.path)
        loaded = ckpt.load_resume(which, self.ckpt_root, model_states=self.job.model_states, rank=self.rt.rank,
                                  runtime=self.rt, required_keys=self.required_keys,
                                  warn_skipped=False)  # setup's resolve_resume_point named them
        self.resume_point = None  # loaded: a second call is a no-op
        if loaded is None:  # every candidate failed to load under auto: a fresh run
            self.logger.rewind(0)
            return 0
        path, states, st = loaded
        self.job.state = type(self.job.state)(**st["trainer"])
        self._restore_sampler(path, st["sampler"])
        self.job.load_state(states, st)
        step = int(st["step"])
        if step != point.step:
            self.logger.rewind(step)
        self.timer.pop()  # loading is not a step's phase
        self.loaded_from = str(path)
        return step

    def _restore_sampler(self, path, state: dict[str, Any]) -> None:
        """The sampler's position; training data of another size (or batching) is a ConfigError at
        ``data.train`` (the config may be unchanged while a data file is not)."""
        try:
            self.job.sampler.load_state_dict(state)
        except ValueError as e:
            raise ConfigError("data.train", f"the training data differs from what the checkpoint {path} was trained on ({e}); "
                                            "resume with that data, or start a new run in another run.output_dir") from None

    def _check_job(self, point: ResumePoint) -> None:
        with open(point.path / ckpt.COMPLETE_MARKER) as f:
            job = json.load(f).get("job", "rl")
        if job != self.job.name:
            raise ValueError(f"{point.path} is a checkpoint of job={job}, not of job={self.job.name}; "
                             f"set checkpoint.resume to a {self.job.name} checkpoint")

    def save(self, step: int) -> None:
        """A checkpoint of ``step`` (a collective), rotated down to ``checkpoint.keep``; never one
        of non-finite weights (:meth:`_check_finite` stops the run first, keeping the last good one)."""
        states = self.job.model_states()
        self.check_finite(step, states)
        trainer_state = {"step": step, "job": self.job.name, "sampler": self.job.sampler.state_dict(), **self.job.job_state(),
                         "trainer": dataclasses.asdict(self.job.state)}
        with stage(f"saving the checkpoint of step {step}", enabled=self.rt.is_main) as shown, self.timer.phase("checkpoint"):
            path = ckpt.save_checkpoint(self.ckpt_root, step, model_states=states, trainer_state=trainer_state,
                                        runtime=self.rt, keep=self.cfg.checkpoint.keep)
            shown.done(f"in {path}")

    def check_finite(self, step: int, states: dict[str, Any]) -> None:
        """Raise :class:`~tidal.run.checkpoint.NonFiniteWeightsError` on every rank when the trained
        state holds NaN/Inf on any rank (a collective), naming the step and the first such tensors:
        a checkpoint of it would rotate the last good one away, a resume from it would train on
        nothing, and an engine given such weights samples garbage. Called before every save, and by
        a job after its update, before the weights reach its engine."""
        bad = ckpt.nonfinite_names(states)
        if self.rt.all_agree(not bad):
            return
        kept = ckpt.complete_checkpoints(self.ckpt_root)
        where = (f"the newest complete checkpoint, {kept[-1]}, is kept: rerun with checkpoint.resume=auto to resume from it"
                 if kept else "no earlier checkpoint exists")
        names = f" ({', '.join(bad)} on rank {self.rt.rank})" if bad else " (on another rank)"
        raise ckpt.NonFiniteWeightsError(
            f"the trained weights hold NaN/Inf after step {step}{names}; no checkpoint of them is written and {where}")

    # ---- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to ``run.steps``; returns the last step's metrics with the first evaluation's as
        ``initial_*``. A SIGINT/SIGTERM stops it after the current step, with a checkpoint (raises
        :class:`~tidal.run.stop.StopRun`). The logger and the watchdog are closed when it ends."""
        with StopRequest() as stop:
            try:
                return self._fit(stop)
            finally:
                self.logger.close()
                self.watchdog.close()
                self.job.close()

    def _fit(self, stop: StopRequest) -> dict[str, float]:
        self.timer.pop()  # setup's phases (a first weight sync) are not step 1's
        with self.watchdog.stage("resume"):
            start = self.resume()
        if start and self.rt.is_main:
            print(f"[tidal] resumed from {self.loaded_from} (step {start})", flush=True)
        cfg, job = self.cfg, self.job
        if start == 0 and cfg.eval.at_start and job.has_eval():
            self._initial_eval()
        last: dict[str, float] = {}
        checkpoints = cfg.checkpoint.every > 0 or cfg.checkpoint.at_end
        for step in range(start + 1, cfg.run.steps + 1):
            self.watchdog.set_step(step)
            metrics = self.step(step)
            final = step == cfg.run.steps
            signum = int(self.rt.all_reduce_max([float(stop.signum)])[0])  # every rank stops after the same step
            if job.has_eval() and not signum and (_due(cfg.eval.every, step) or (final and cfg.eval.at_end)):
                metrics.update(job.evaluate(step))
            if _due(cfg.checkpoint.every, step) or (final and cfg.checkpoint.at_end) or (signum and checkpoints):
                self.save(step)
            metrics.update(self.timer.pop())
            self.logger.log(step, metrics)
            last = metrics
            if signum and not final:
                raise StopRun(step, signum, saved=checkpoints)
        if any(k.startswith("eval/") for k in last):
            job.announce("end", {k: v for k, v in last.items() if k.startswith("eval/")})
        job.finish()
        return {**{f"initial_{k}": v for k, v in job.state.initial_eval.items()}, **last}

    def step(self, step: int) -> dict[str, float]:
        """The job's training step ``step`` with its skipped optimizer steps counted (too many in a
        row stop the run: :meth:`_track_skips`)."""
        metrics = self.job.train_step(step)
        self._track_skips(step, metrics)
        return metrics

    def _initial_eval(self) -> None:
        initial = self.job.evaluate(0)
        initial.update(self.timer.pop())
        if self.job.logs_initial_eval:
            self.logger.log_start(initial)  # step 0 of metrics.jsonl: where the curves start
        self.job.state.initial_eval = {k: v for k, v in initial.items() if not k.startswith("time/")}
        self.job.announce("start", self.job.state.initial_eval)

    def _track_skips(self, step: int, metrics: dict[str, float]) -> None:
        """Count skipped optimizer steps (``<prefix>/skipped_total``); too many in a row stop the run
        (a collective then: when the weights themselves hold NaN/Inf, that is what is said)."""
        state, key = self.job.state, self.job.skip_key
        skipped = metrics.get(key, 0.0) > 0
        state.skipped_total += int(skipped)
        state.skipped_in_a_row = state.skipped_in_a_row + 1 if skipped else 0
        metrics[f"{key}_total"] = float(state.skipped_total)
        limit = self.cfg.train.max_skipped_steps_in_a_row
        if state.skipped_in_a_row >= limit:
            self.check_finite(step, self.job.model_states())
            raise RuntimeError(
                f"{state.skipped_in_a_row} optimizer steps in a row had a non-finite gradient norm "
                f"(train.max_skipped_steps_in_a_row={limit}); {self.job.skip_hint}"
            )


def _due(every: int, step: int) -> bool:
    return bool(every) and step % every == 0
