"""RewardModelTrainer: Bradley-Terry training of a scalar reward model under a Strategy.

One step: this rank's ``batch_pairs / WORLD_SIZE`` pairs from the stateful sampler -> token-budget
micro-batches (both sequences of a pair in the same one) -> each micro-batch's loss share
``sum_p loss_p / batch_pairs`` to ``strategy.backward`` (the shares of all micro-batches and ranks
sum to the global batch's mean loss: the Strategy's gradient contract) -> ``optimizer_step`` (clip,
skip on a non-finite norm, LR schedule). Every rank runs the same number of forward passes (padding
with zero-weight ones), because sharded forwards are collectives. The update runs inside its
placement phase (:meth:`tidal.trainer.colocation.Placement.update`: optimizer state on the device
inside, back at rest after, also on error). The job loop (:class:`tidal.run.loop.JobLoop`) runs the
steps: evaluation (pairwise accuracy, margin) at the start, every ``eval.every`` steps and at the
end; checkpoints and exact resume with fall-back under ``checkpoint.resume: auto``; a SIGINT/SIGTERM
stops after the current step with a checkpoint (exit code 75).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tidal.logging import MetricsLogger, PhaseTimer
from tidal.data import StatefulDistributedSampler
from tidal.rm.dataset import Pair, PreferenceDataset
from tidal.rm.loss import PairMeans, bradley_terry_loss, pair_sums
from tidal.rm.model import score_pairs
from tidal.strategy.base import Strategy, TrainState, apply_optim_settings
from tidal.run import faults
from tidal.run.loop import JobLoop, LoopState
from tidal.run.resume import ResumePoint
from tidal.trainer.colocation import Placement
from tidal.trainer.config import require_resolved
from tidal.trainer.experience import token_budget_batches
from tidal.trainer.update import nonfinite_guard
from tidal.run.watchdog import Watchdog

EXPORT_DIR = "export"


def pair_micro_batches(pairs: list[Pair], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices of ``pairs`` per micro-batch: 2 x pairs x longest sequence <= ``max_tokens`` and
    2 x pairs <= ``max_seqs`` (a single longer pair still gets its own micro-batch)."""
    return token_budget_batches([p.length for p in pairs], max(1, max_tokens // 2), max(1, max_seqs // 2))


RM_STATE_KEYS = ("step", "sampler", "trainer")  # what the reward-model job reads of trainer.json


class RewardModelTrainer:
    """The reward-model job, run by the job loop (:class:`tidal.run.loop.JobLoop`)."""

    name = "reward_model"
    skip_key = "train/skipped"
    skip_hint = "lower optim.lr, check the data"
    logs_initial_eval = False

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
        self.state = LoopState()
        self.placement = Placement(strategy=strategy, timer=timer, trained={"reward_model": state})
        self.loop = JobLoop(self, cfg=cfg, runtime=self.rt, timer=timer, watchdog=watchdog, logger=logger, resume=resume,
                            required_keys=RM_STATE_KEYS)

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
        with self.timer.phase("train"), self.placement.update(self.model_state):
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
        metrics = {f"train/{k}": v for k, v in means.result(self.rt.all_reduce_sum).items() if k != "pairs"}
        metrics.update({f"train/{k}": v for k, v in step_metrics.items()})
        metrics["data/epoch"] = self.sampler.epoch + self.sampler.step_in_epoch / self.sampler.steps_per_epoch
        return metrics

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

    def has_eval(self) -> bool:
        return bool(self.eval_pairs)

    # ---- state -------------------------------------------------------------------------------------
    def model_states(self) -> dict:
        return {"reward_model": self.strategy.state_dict(self.model_state)}

    def job_state(self) -> dict:
        return {}

    def load_state(self, states: dict, trainer_state: dict) -> None:
        """The loaded model and optimizer, with this run's ``optim`` settings (a changed LR applies)."""
        self.strategy.load_state_dict(self.model_state, states["reward_model"])
        apply_optim_settings(self.model_state, self.cfg.optim, lr=self.cfg.optim.lr)

    # ---- the loop ----------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the resume point's checkpoint (:meth:`JobLoop.resume`: model, optimizer, schedule,
        sampler position, RNG, with fall-back under ``auto``); its step, 0 for a fresh run."""
        return self.loop.resume()

    @property
    def loaded_from(self) -> str | None:
        """The checkpoint :meth:`resume` loaded."""
        return self.loop.loaded_from

    def fit(self) -> dict[str, float]:
        """Train to ``run.steps`` (:meth:`JobLoop.fit`); returns the last step's metrics with the
        first evaluation's as ``initial_*``. Writes the export at the end when
        ``reward_model.export_at_end``. A SIGINT/SIGTERM stops it after the current step, with a
        checkpoint (raises StopRun)."""
        if self.cfg.reward_model.export_at_end:  # an export it may not write fails now, not after training
            from tidal.trainer.export import check_export_target

            check_export_target(Path(self.cfg.run.output_dir) / EXPORT_DIR, key="reward_model.export_at_end")
        return self.loop.fit()

    def finish(self) -> None:
        """The export at the end (``reward_model.export_at_end``)."""
        from tidal.rm.export import export_reward_model, export_summary

        export_dir = Path(self.cfg.run.output_dir) / EXPORT_DIR
        cfg = self.cfg
        if cfg.reward_model.export_at_end:
            with self.timer.phase("export"):
                out = export_reward_model(self, export_dir, source=f"step {cfg.run.steps} of {cfg.run.output_dir}",
                                          key="reward_model.export_at_end")
            if self.rt.is_main:
                print(f"[tidal] {export_summary(out, self.strategy.param_dtype, f'step {cfg.run.steps} (the end of training)')}", flush=True)

    def close(self) -> None:
        pass

    def announce(self, when: str, metrics: dict[str, float]) -> None:
        if self.rt.is_main:
            shown = ", ".join(f"{k.split('/', 1)[1]}={v:.4f}" for k, v in sorted(metrics.items()) if k.startswith("eval/") and not math.isnan(v))
            print(f"[tidal] reward-model eval at {when}: {shown}", flush=True)
