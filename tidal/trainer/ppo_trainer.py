"""PPOTrainer: the colocated RL loop of spec §7, for PPO and the GRPO family alike.

One iteration: sample this rank's prompts -> ExperienceMaker (rollout phase, actor / reference /
critic forwards, rewards, advantages) -> Updater (policy and critic steps) -> weight sync ->
metrics, evaluation, checkpoint. The algorithm variant is entirely in
:class:`tidal.algorithms.Algorithm` (the trainer asks it, never reads its settings); the backend
entirely in the Strategy; what sits on the device in each phase entirely in
:class:`tidal.trainer.colocation.Colocation`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from tidal.algorithms import Algorithm
from tidal.data import PromptDataset, PromptItem, StatefulDistributedSampler
from tidal.distributed.runtime import Runtime
from tidal.engine.base import SamplingParams
from tidal.logging import MetricsLogger, TrajectoryWriter
from tidal.logging.console import format_value
from tidal.logging.progress import stage
from tidal.logging.reduce import reduce_over_ranks, with_absent
from tidal.rewards import RewardEngine
from tidal.rewards.alarms import RewardAlarms
from tidal.strategy.base import apply_optim_settings
from tidal.sync import WeightSyncError, mismatch_alarm
from tidal.run import checkpoint as ckpt
from tidal.run import faults
from tidal.trainer.colocation import Colocation, Models
from tidal.trainer.config import TrainerSections
from tidal.trainer.evaluate import evaluate, shard_items
from tidal.trainer.experience import Experience, concat_experiences, first_group_id
from tidal.trainer.experience_maker import ExperienceMaker
from tidal.trainer.partial import LongTailRollout, dropped_note, per_rank_states
from tidal.trainer.perf import PerfMeter
from tidal.run.loop import JobLoop, LoopState
from tidal.run.run_dir import RunDir
from tidal.trainer.update import Updater
from tidal.run.watchdog import StageTimer


EVAL_SEED_SALT = 99  # step_seed's salt of an evaluation's sampling (tidal eval draws what the run's eval at that step drew)


def step_seed(seed: int, step: int, rank: int, salt: int = 0) -> int:
    """A sampling seed that depends only on (seed, step, rank, salt): a resumed run draws the same."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + salt) % (2**31 - 1)


def reduce_rollout_metrics(runtime: Runtime, metrics: dict[str, float]) -> dict[str, float]:
    """This rank's rollout metrics combined over all ranks by the naming contract of
    :mod:`tidal.logging.reduce` (counts summed, ``_max``/``_min`` extremes, weighted and plain means).
    The keys are the union over ranks (an environment counter one rank never saw counts as nothing
    there: :func:`~tidal.logging.reduce.with_absent`)."""
    if runtime.world_size > 1:
        keys = sorted(set().union(*runtime.all_gather_objects(sorted(metrics))))
        metrics = with_absent(metrics, keys)
    return reduce_over_ranks(metrics, world_size=runtime.world_size, all_reduce_sum=runtime.all_reduce_sum,
                             all_reduce_max=runtime.all_reduce_max)


@dataclasses.dataclass(kw_only=True)
class TrainerState(LoopState):
    step: int = 0
    sync_alarms: int = 0


@dataclasses.dataclass(kw_only=True)
class RunData:
    """The prompts of a run: the training set with this rank's sampler, and the eval prompts."""

    train: PromptDataset
    sampler: StatefulDistributedSampler
    eval_items: list[PromptItem]


class PPOTrainer:
    """The RL job, run by the job loop (:class:`tidal.run.loop.JobLoop`: resume, cadence, stop
    signals, skip accounting). ``cfg`` holds the config sections it reads (:class:`TrainerSections`);
    each component it builds gets its own sections. ``run_dir``: the run directory's lock (released
    when :meth:`fit` ends) and the resume point resolved at setup."""

    name = "rl"
    skip_key = "actor/skipped"
    skip_hint = "lower optim.lr, check rewards for NaN/Inf"
    logs_initial_eval = True

    def __init__(self, *, cfg: TrainerSections, colocation: Colocation, models: Models, rewards: RewardEngine,
                 algorithm: Algorithm, data: RunData, logger: MetricsLogger, run_dir: RunDir):
        self.cfg = cfg
        # set by build_trainer: the settings the run was built with and their plan (tidal.memory.plan.MemorySettings)
        self.memory = None
        self.colocation = colocation
        self.models = models
        self.rewards = rewards
        self.algo = algorithm
        self.data = data
        self.logger = logger
        self.run_dir = run_dir
        self.eval_s: float | None = None  # how long the last evaluation took (the next one's remaining time)
        self.timer: StageTimer = colocation.timer
        self.watchdog = self.timer.watchdog
        self.rt = colocation.runtime
        self.state = TrainerState()
        # rewards that teach nothing: all equal (unless a teacher teaches), answers unread
        self.reward_alarms = RewardAlarms(all_equal=bool(rewards.components) and not algorithm.needs_teacher)
        self.trajectories = TrajectoryWriter(Path(cfg.run.output_dir)) if self.rt.is_main else None
        self.maker = ExperienceMaker(colocation=colocation, rewards=rewards, algorithm=algorithm, rollout=cfg.rollout,
                                     train=cfg.train, model=cfg.model, env=cfg.env, reward=cfg.reward)
        self.perf = PerfMeter(models=models, timer=self.timer, device=self.rt.device, compiles=colocation.strategy.compiles,
                              compile_cache_dir=cfg.strategy.compile_cache_dir, is_main=self.rt.is_main, epochs=cfg.train.epochs)
        self.long_tail = None  # rollout.partial: the groups in flight across steps
        if cfg.rollout.partial.enabled:
            self.long_tail = LongTailRollout(cfg.rollout.partial, groups_per_step=cfg.rollout.prompts_per_step // self.rt.world_size,
                                             n_samples=cfg.rollout.n_samples, rank=self.rt.rank, runtime=self.rt,
                                             dataset=data.train, draw=lambda: self._next_items()[1])
        self.updater = Updater(models=models, colocation=colocation, algorithm=algorithm, rollout=cfg.rollout, train=cfg.train,
                               model=cfg.model, split=self.perf.split)
        self.loop = JobLoop(self, cfg=cfg, runtime=self.rt, timer=self.timer, watchdog=self.watchdog, logger=logger,
                            resume=run_dir.resume, required_keys=ckpt.TRAINER_STATE_KEYS)

    # ---- one iteration ---------------------------------------------------------------------------
    def sampling_params(self, step: int, attempt: int = 0) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, max_new_tokens=r.max_new_tokens, n=r.n_samples,
            ignore_eos=r.ignore_eos, seed=step_seed(self.cfg.run.seed, step, self.rt.rank, attempt),
        )

    def _next_items(self) -> tuple[list[PromptItem], int]:
        idx = self.data.sampler.next_batch()
        faults.hit("sampled", rank=self.rt.rank, data=idx)
        return [self.data.train[i] for i in idx], idx

    def collect(self, step: int) -> tuple[Experience, dict[str, float], list]:
        """Rollout + experience for one step, in up to ``algorithm.sampling_rounds`` rounds: groups
        the algorithm does not keep (DAPO dynamic sampling: zero reward variance) are dropped and more
        prompts are sampled until this rank has ``prompts_per_rank`` groups or the rounds are used
        up (all ranks make equally many rounds). With one round every group is kept."""
        if self.long_tail is not None:  # rollout.partial: one rollout of the groups in flight
            return self.maker.make(self.maker.generate_partial(self.long_tail, step, self.sampling_params(step)))
        per_rank = self.cfg.rollout.prompts_per_step // self.rt.world_size
        rounds = self.algo.sampling_rounds
        kept: list[Experience] = []
        kept_groups = 0
        metrics: dict[str, float] = {}
        samples_all: list = []
        tries = 0
        while True:
            items, _ = self._next_items()
            first_gid = first_group_id(step, self.rt.rank, per_rank, attempt=tries)
            rollout = self.maker.generate(items, self.sampling_params(step, tries), first_gid)
            exp, m, samples = self.maker.make(rollout)
            tries += 1
            if not metrics:
                metrics, samples_all = m, samples
            keep_B = self.algo.keep_groups(exp.rewards_B, exp.group_ids_B)
            gids = torch.unique(exp.group_ids_B[keep_B])
            take = gids[: per_rank - kept_groups]
            if len(take) == len(torch.unique(exp.group_ids_B)) and not kept:
                kept, kept_groups = [exp], len(take)  # the whole rollout: no copy
            elif len(take):
                kept.append(exp.select(torch.isin(exp.group_ids_B, take).nonzero().flatten().tolist()))
                kept_groups += len(take)
            done = float(kept_groups >= per_rank or tries >= rounds)
            if self.rt.all_reduce_sum([1.0 - done])[0] == 0:  # every rank finished
                break
        if rounds > 1:
            metrics["dynamic_sampling/tries"] = float(tries)
            metrics["dynamic_sampling/kept_groups_count"] = float(kept_groups)
            metrics["dynamic_sampling/filled_frac"] = kept_groups / per_rank
        if not kept:  # nothing with signal: train on the last batch with its (zero) advantages
            kept = [exp]
        return concat_experiences(kept) if len(kept) > 1 else kept[0], metrics, samples_all

    def train_step(self, step: int) -> dict[str, float]:
        engine = self.colocation.engine
        overlap = getattr(engine, "overlap", None)  # the native engine's schedule-ahead share
        stats_before = dict(engine.stats) if overlap is not None else None
        exp, rollout_metrics, samples = self.collect(step)
        if overlap is not None:
            rollout_metrics["engine/ahead_frac"] = overlap(stats_before)["ahead_frac"]
        metrics = reduce_rollout_metrics(self.rt, rollout_metrics)
        gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, 0, salt=7))
        with self.timer.phase("train"):
            update = self.updater.train(exp, generator=gen)
        metrics.update(update.flat())
        # weights an update left NaN/Inf are named here: given to the engine, a read-back calls them
        # stale (sync.verify) and, without it, the sampler fails on garbage
        actor = {n: getattr(p, "ds_tensor", p) for n, p in self.models.actor.model.named_parameters()}  # ZeRO-3: its partition
        self.loop.check_finite(step, {"actor": actor})
        self.colocation.sync_weights(version=step)
        self.algo.update_after_step(update.actor)
        self._mismatch_alarm(metrics)
        self._warn(self.reward_alarms.step(metrics))
        metrics.update(self.timer.pop())
        metrics["time/step"] = sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/step")
        # after time/step: compile time is inside the phases that compiled, not added to them
        metrics.update(self.perf.pop(exp.attention_mask_BT.sum(-1).tolist(), metrics.get("time/train", 0.0)))
        # the device's memory by component (CUDA): used, allocator peak, trained models' weights,
        # optimizer state and update peaks, the engine's weights, KV cache and graphs
        metrics.update(self.colocation.memory.pop(self.colocation.engine_memory))
        self.run_dir.check_intact(self.rt)  # before anything of this step is written there
        if self.trajectories is not None and self.cfg.logging.trajectories_due(step):
            self.trajectories.write(step, self._trajectory_records(samples, exp))
        return metrics

    def _mismatch_alarm(self, metrics: dict[str, float]) -> None:
        """``sync.max_logp_diff``: warn (counted in ``sync/alarms``) or stop when the engine samples
        from a policy far from the trainer's. The metrics are reduced over ranks: all ranks agree."""
        sync = self.cfg.sync
        message = mismatch_alarm(metrics, sync.max_logp_diff)
        self.state.sync_alarms += message is not None
        metrics["sync/alarms"] = float(self.state.sync_alarms)
        if message is None:
            return
        if sync.on_alarm == "stop":
            raise WeightSyncError(f"{message} (sync.on_alarm=stop)")
        if self.rt.is_main:
            print(f"[tidal] warning: {message}", flush=True)

    def _warn(self, messages: list[str]) -> None:
        if self.rt.is_main:
            for message in messages:
                print(f"[tidal] warning: {message}", flush=True)

    def _trajectory_records(self, samples, exp: Experience) -> list[dict]:
        """One record per row with a scored sample (``samples`` is aligned with the rows); with a
        multi-turn environment also the whole conversation (``messages``); ``trained``: the row as
        the update saw it (:meth:`Experience.row`)."""
        n = min(len(samples), len(exp))
        records = []
        for i, s in enumerate(samples[:n]):
            if s is None:  # a trajectory without any turn (its environment failed at reset)
                continue
            record = {
                "prompt": s.prompt, "response": s.response, "reference": s.reference,
                "reward": float(exp.rewards_B[i]), "finish_reason": s.finish_reason,
                "rollout_logprobs": exp.rollout_logp_BT[i][exp.action_mask_BT[i].bool()].tolist(),
            }
            if self.maker.multi_turn:
                record["messages"] = s.messages
            record["trained"] = exp.row(i)  # the token ids, masks, logprobs and advantages the update used
            records.append(record)
        return records

    # ---- evaluation / checkpoints ----------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Eval metrics of the current policy over all ranks, with ``time/eval`` (its inner phases
        are not step phases, so they are left out)."""
        items = shard_items(self.data.eval_items, self.rt.rank, self.rt.world_size)
        pending = self.timer.pop()  # the step's own phases, given back below
        what = "at the start" if step == 0 else f"at step {step}"
        with stage(f"evaluating {len(self.data.eval_items)} prompts {what}", enabled=self.rt.is_main,
                   expected_s=self.eval_s) as shown, self.timer.phase("eval"):
            out = evaluate(
                self.maker, items, self.cfg.eval, max_new_tokens=self.cfg.rollout.max_new_tokens,
                seed=step_seed(self.cfg.run.seed, step, self.rt.rank, salt=EVAL_SEED_SALT),
            )
            shown.done(", ".join(f"{k[5:]} {v:.3f}" for k, v in out.items() if k.endswith("accuracy") or "pass@" in k))
        out["time/eval"] = self.eval_s = self.timer.pop()["time/eval"]
        return {**pending, **out}

    def has_eval(self) -> bool:
        return bool(self.data.eval_items)

    def model_states(self) -> dict:
        strategy, m = self.colocation.strategy, self.models
        states = {"actor": strategy.state_dict(m.actor)}
        if m.critic is not None:
            states["critic"] = strategy.state_dict(m.critic)
        return states

    @property
    def sampler(self) -> StatefulDistributedSampler:
        return self.data.sampler

    def job_state(self) -> dict:
        """Algorithm state; with ``rollout.partial`` every rank's groups in flight (a collective)."""
        out = {"algorithm": self.algo.state_dict()}
        if self.long_tail is not None:
            state = self.long_tail.state_dict()
            out["partial"] = self.rt.all_gather_objects(state) if self.rt.world_size > 1 else [state]
        return out

    def load_state(self, states: dict, trainer_state: dict) -> None:
        """Loaded models (with this run's ``optim`` settings: a changed LR applies), algorithm and
        groups in flight; then the engine gets the weights."""
        strategy, m, st, optim = self.colocation.strategy, self.models, trainer_state, self.cfg.optim
        strategy.load_state_dict(m.actor, states["actor"])
        apply_optim_settings(m.actor, optim, lr=optim.lr)
        if m.critic is not None:
            strategy.load_state_dict(m.critic, states["critic"])
            apply_optim_settings(m.critic, optim, lr=optim.critic_lr)
        self.algo.load_state_dict(st["algorithm"])
        if self.long_tail is not None and "partial" in st:
            mine = per_rank_states(st["partial"], self.rt.rank, self.rt.world_size)
            if mine is not None:
                self.long_tail.load_state_dict(mine)
            else:
                self._warn([dropped_note(st["partial"], self.rt.world_size)])
        self.colocation.sync_weights(version=int(st["step"]))

    # ---- the loop -------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint chosen at setup and sync the engine (:meth:`JobLoop.resume`); its step."""
        return self.loop.resume()

    @property
    def loaded_from(self) -> str | None:
        """The checkpoint :meth:`resume` loaded."""
        return self.loop.loaded_from

    def fit(self) -> dict[str, float]:
        """Run to ``run.steps`` (:meth:`JobLoop.fit`); returns the final metrics (with start/end eval
        when configured). A SIGINT/SIGTERM stops it after the current step, with a checkpoint."""
        return self.loop.fit()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.perf.close()
        self.run_dir.lock.release()

    def announce(self, when: str, metrics: dict[str, float]) -> None:
        """Print the eval metrics (at the end only when the run also evaluated at the start)."""
        if when == "start" or self.state.initial_eval:
            self._announce(when, metrics)
        if when == "start":
            self._warn(self.reward_alarms.start_eval(metrics))

    def _announce(self, when: str, metrics: dict[str, float]) -> None:
        """Print the eval metrics; the environment's (``eval/env/*``) on a line of their own, the
        nonzero ones only."""
        if not self.rt.is_main:
            return
        plain = {k: v for k, v in metrics.items() if not k.startswith("eval/env/")}
        shown = ", ".join(f"{k.split('/', 1)[1]} {format_value(k, v)}" for k, v in sorted(plain.items()) if not math.isnan(v))
        print(f"[tidal] eval at {when}: {shown}", flush=True)
        env = ", ".join(f"{k[len('eval/env/'):]} {format_value(k, v)}" for k, v in sorted(metrics.items())
                        if k.startswith("eval/env/") and v and not math.isnan(v))
        if env:
            print(f"[tidal]   environment: {env}", flush=True)
