"""RewardModelTrainer: Bradley-Terry training of a scalar reward model under a Strategy.

One step: this rank's ``batch_pairs / WORLD_SIZE`` pairs from the stateful sampler -> token-budget
micro-batches (both sequences of a pair in the same one) -> each micro-batch's loss share
``sum_p loss_p / batch_pairs`` to ``strategy.backward`` (the shares of all micro-batches and ranks
sum to the global batch's mean loss: the Strategy's gradient contract) -> ``optimizer_step`` (clip,
skip on a non-finite norm, LR schedule). Every rank runs the same number of forward passes (padding
with zero-weight ones), because sharded forwards are collectives. Evaluation (pairwise accuracy,
margin) at the start, every ``eval.every`` steps and at the end; checkpoints and exact resume
through :mod:`tidal.run.checkpoint`; metrics through the MetricsLogger; a SIGINT/SIGTERM stops
after the current step with a checkpoint (:mod:`tidal.run.stop`, exit code 75).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from tidal.logging import MetricsLogger, PhaseTimer
from tidal.data import StatefulDistributedSampler
from tidal.rm.dataset import Pair, PreferenceDataset
from tidal.rm.loss import PairMeans, bradley_terry_loss, pair_sums
from tidal.rm.model import score_pairs
from tidal.strategy.base import Strategy, TrainState
from tidal.run import checkpoint as ckpt
from tidal.run import faults
from tidal.trainer.config import require_resolved
from tidal.trainer.experience import token_budget_batches
from tidal.run.resume import ResumePoint
from tidal.run.stop import StopRequest, StopRun
from tidal.trainer.update import nonfinite_guard
from tidal.run.watchdog import Watchdog

EXPORT_DIR = "export"


def pair_micro_batches(pairs: list[Pair], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices of ``pairs`` per micro-batch: 2 x pairs x longest sequence <= ``max_tokens`` and
    2 x pairs <= ``max_seqs`` (a single longer pair still gets its own micro-batch)."""
    return token_budget_batches([p.length for p in pairs], max(1, max_tokens // 2), max(1, max_seqs // 2))


@dataclasses.dataclass(kw_only=True)
class RMTrainerState:
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    initial_eval: dict[str, float] = dataclasses.field(default_factory=dict)


class RewardModelTrainer:
    def __init__(
        self, *, cfg, strategy: Strategy, tokenizer, state: TrainState, pad_id: int, train_data: PreferenceDataset,
        eval_pairs: list[Pair], sampler: StatefulDistributedSampler, logger: MetricsLogger, timer: PhaseTimer,
        watchdog: Watchdog, resume: ResumePoint | None,
    ):
        """``cfg``: the root config with its ``auto`` settings resolved (``MemorySettings.run_config``);
        ``resume``: the checkpoint :meth:`resume` loads (resolved at setup), None for a fresh run."""
        require_resolved(cfg.train, "train", "micro_batch_tokens", "forward_micro_batch_tokens")
        self.cfg = cfg
        self.strategy = strategy
        self.rt = strategy.runtime
        self.tokenizer = tokenizer
        self.model_state = state
        self.pad_id = pad_id
        self.train_data = train_data
        self.eval_pairs = eval_pairs
        self.sampler = sampler
        self.logger = logger
        self.timer = timer
        self.watchdog = watchdog
        self.state = RMTrainerState()
        self.resume_point = resume
        self.loaded_from: str | None = None  # the checkpoint :meth:`resume` loaded
        self.ckpt_root = ckpt.checkpoint_root(cfg.run.output_dir)

    @property
    def model(self) -> torch.nn.Module:
        return self.model_state.model

    # ---- forward passes ----------------------------------------------------------------------------
    def _passes(self, pairs: list[Pair], max_tokens: int, max_seqs: int) -> tuple[list[list[Pair]], int]:
        """This rank's micro-batches of ``pairs`` and the number of passes every rank runs (the max)."""
        batches = [[pairs[i] for i in idx] for idx in pair_micro_batches(pairs, max_tokens, max_seqs)] if pairs else []
        return batches, int(self.rt.all_reduce_max([float(len(batches))])[0])

    def _score(self, batch: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        return score_pairs(self.model, batch, pad_id=self.pad_id, device=self.strategy.device)

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        rm, train = self.cfg.reward_model, self.cfg.train
        idx = self.sampler.next_batch()
        faults.hit("sampled", rank=self.rt.rank, data=idx)
        pairs = [self.train_data[i] for i in idx]
        batches, total = self._passes(pairs, train.micro_batch_tokens, train.micro_batch_max_seqs)
        means = PairMeans()
        offload = self.strategy.cfg.offload_optimizer  # a bool: the Strategy's resolved section
        with self.timer.phase("train"):
            if offload:
                self.strategy.reload_optimizer(self.model_state)
            for i in range(total):
                real = i < len(batches)
                batch = batches[i] if real else batches[0]
                r_c, r_r = self._score(batch)
                r_c = faults.corrupt("rm_scores", r_c)  # test-only NaN/Inf injection (TIDAL_FAULT)
                loss_P = bradley_terry_loss(r_c, r_r, center_coef=rm.center_rewards_coef)
                share = loss_P.sum() / rm.batch_pairs  # sums to the global batch's mean loss over micro-batches and ranks
                if real:
                    means.add(pair_sums(r_c, r_r, loss_P), len(batch))
                else:
                    share = share * 0.0
                share = nonfinite_guard(share, torch.cat([r_c, r_r]))
                self.strategy.backward(share, self.model_state, sync_grads=i == total - 1)
            step_metrics = self.strategy.optimizer_step(self.model_state)
            if offload:
                self.strategy.offload_optimizer(self.model_state)
        metrics = {f"train/{k}": v for k, v in means.result(self.rt.all_reduce_sum).items() if k != "pairs"}
        metrics.update({f"train/{k}": v for k, v in step_metrics.items()})
        self._track_skips(metrics)
        metrics["data/epoch"] = self.sampler.epoch + self.sampler.step_in_epoch / self.sampler.steps_per_epoch
        return metrics

    def _track_skips(self, metrics: dict[str, float]) -> None:
        skipped = metrics.get("train/skipped", 0.0) > 0
        self.state.skipped_total += int(skipped)
        self.state.skipped_in_a_row = self.state.skipped_in_a_row + 1 if skipped else 0
        metrics["train/skipped_total"] = float(self.state.skipped_total)
        limit = self.cfg.train.max_skipped_steps_in_a_row
        if self.state.skipped_in_a_row >= limit:
            raise RuntimeError(
                f"{self.state.skipped_in_a_row} optimizer steps in a row had a non-finite gradient norm "
                f"(train.max_skipped_steps_in_a_row={limit}); lower optim.lr, check the data"
            )

    # ---- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Pairwise accuracy, mean margin, loss and mean rewards over all eval pairs (every rank
        scores pairs r, r+W, ...). Model in eval mode (no dropout) for the duration."""
        train = self.cfg.train
        pairs = self.eval_pairs[self.rt.rank :: self.rt.world_size]
        batches, total = self._passes(pairs, train.forward_micro_batch_tokens, train.forward_micro_batch_max_seqs)
        means = PairMeans()
        coef = self.cfg.reward_model.center_rewards_coef
        self.model.eval()
        try:
            with self.timer.phase("eval"):
                for i in range(total):
                    batch = batches[i] if i < len(batches) else [self.eval_pairs[0]]  # a pass the others need
                    r_c, r_r = self._score(batch)
                    if i < len(batches):
                        means.add(pair_sums(r_c, r_r, bradley_terry_loss(r_c, r_r, center_coef=coef)), len(batch))
        finally:
            self.model.train()
        result = means.result(self.rt.all_reduce_sum)
        # the count goes with the data, not among the eval curves (a panel of report.png each)
        return {"data/eval_pairs": result.pop("pairs"), **{f"eval/{k}": v for k, v in result.items()}}

    # ---- checkpoints -------------------------------------------------------------------------------
    def _model_states(self) -> dict:
        return {"reward_model": self.strategy.state_dict(self.model_state)}

    def save(self, step: int) -> None:
        trainer_state = {"step": step, "job": "reward_model", "sampler": self.sampler.state_dict(), "trainer": dataclasses.asdict(self.state)}
        with self.timer.phase("checkpoint"):
            ckpt.save_checkpoint(self.ckpt_root, step, model_states=self._model_states(), trainer_state=trainer_state,
                                 runtime=self.rt, keep=self.cfg.checkpoint.keep)

    def resume(self) -> int:
        """Load the resume point's checkpoint (model, optimizer, schedule, sampler position, RNG);
        returns its step, 0 for a fresh run. A second call is a no-op. The checkpoint's path is kept
        in ``loaded_from``; the caller says what it loaded it for (training, eval, export)."""
        point = self.resume_point
        if point is None:
            return 0
        with open(point.path / ckpt.COMPLETE_MARKER) as f:
            job = json.load(f).get("job", "rl")
        if job != "reward_model":
            raise ValueError(f"{point.path} is a checkpoint of job={job}, not of job=reward_model; set checkpoint.resume to a reward-model checkpoint")
        states = self._model_states()
        st = ckpt.load_checkpoint(point.path, model_states=states, rank=self.rt.rank)
        self.strategy.load_state_dict(self.model_state, states["reward_model"])
        self.sampler.load_state_dict(st["sampler"])
        self.state = RMTrainerState(**st["trainer"])
        self.resume_point = None
        self.loaded_from = str(point.path)
        return point.step

    # ---- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Train to ``run.steps``; returns the last step's metrics with the first evaluation's as
        ``initial_*``. Writes the export at the end when ``reward_model.export_at_end``. A SIGINT /
        SIGTERM stops it after the current step, with a checkpoint (raises StopRun)."""
        with StopRequest() as stop:
            try:
                last = self._fit(stop)
            finally:
                self.logger.close()
                self.watchdog.close()
        return last

    def _fit(self, stop: StopRequest) -> dict[str, float]:
        from tidal.rm.export import export_reward_model, export_summary
        from tidal.trainer.export import check_export_target

        export_dir = Path(self.cfg.run.output_dir) / EXPORT_DIR
        if self.cfg.reward_model.export_at_end:  # an export it may not write fails now, not after training
            check_export_target(export_dir, key="reward_model.export_at_end")
        with self.watchdog.stage("resume"):
            start = self.resume()
        if start and self.rt.is_main:
            print(f"[tidal] resumed from {self.loaded_from} (step {start})", flush=True)
        cfg = self.cfg
        if start == 0 and cfg.eval.at_start and self.eval_pairs:
            self.state.initial_eval = self.evaluate(0)
            self.timer.pop()
            self._announce("start", self.state.initial_eval)
        checkpoints = cfg.checkpoint.every > 0 or cfg.checkpoint.at_end
        last: dict[str, float] = {}
        for step in range(start + 1, cfg.run.steps + 1):
            self.watchdog.set_step(step)
            metrics = self.train_step(step)
            final = step == cfg.run.steps
            signum = int(self.rt.all_reduce_max([float(stop.signum)])[0])  # every rank stops after the same step
            if self.eval_pairs and not signum and ((cfg.eval.every and step % cfg.eval.every == 0) or (final and cfg.eval.at_end)):
                metrics.update(self.evaluate(step))
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or (final and cfg.checkpoint.at_end) or (signum and checkpoints):
                self.save(step)
            metrics.update(self.timer.pop())
            self.logger.log(step, metrics)
            last = metrics
            if signum and not final:
                raise StopRun(step, signum, saved=checkpoints)
        if any(k.startswith("eval/") for k in last):
            self._announce("end", last)
        if cfg.reward_model.export_at_end:
            with self.timer.phase("export"):
                out = export_reward_model(self, export_dir, source=f"step {cfg.run.steps} of {cfg.run.output_dir}",
                                          key="reward_model.export_at_end")
            if self.rt.is_main:
                print(f"[tidal] {export_summary(out, self.strategy.param_dtype, f'step {cfg.run.steps} (the end of training)')}", flush=True)
        return {**{f"initial_{k}": v for k, v in self.state.initial_eval.items()}, **last}

    def _announce(self, when: str, metrics: dict[str, float]) -> None:
        if self.rt.is_main:
            shown = ", ".join(f"{k.split('/', 1)[1]}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("eval/") and not math.isnan(v))
            print(f"[tidal] reward-model eval at {when}: {shown}", flush=True)
