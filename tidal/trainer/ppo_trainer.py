"""PPOTrainer: the colocated RL loop of spec §7, for PPO and the GRPO family alike.

One iteration: sample this rank's prompts -> ExperienceMaker (engine wake, generate, sleep, actor /
reference / critic forwards, rewards, advantages) -> Updater (policy and critic steps) ->
``update_engine_weights`` -> metrics, evaluation, checkpoint. The algorithm variant is entirely in
:class:`tidal.algorithms.Algorithm`; the backend entirely in the Strategy.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from tidal.algorithms import Algorithm
from tidal.data import PromptDataset, PromptItem, StatefulDistributedSampler
from tidal.engine.base import RolloutEngine, SamplingParams
from tidal.logging import MetricsLogger, PhaseTimer, TrajectoryWriter
from tidal.strategy.base import Strategy, TrainState
from tidal.trainer import checkpoint as ckpt
from tidal.trainer import faults
from tidal.trainer.evaluate import evaluate, shard_items
from tidal.trainer.experience import Experience, concat_experiences
from tidal.trainer.experience_maker import ExperienceMaker, Rollout
from tidal.trainer.update import Updater
from tidal.trainer.watchdog import Watchdog


def step_seed(seed: int, step: int, rank: int, salt: int = 0) -> int:
    """A sampling seed that depends only on (seed, step, rank, salt): a resumed run draws the same."""
    return (seed * 1_000_003 + step * 10_007 + rank * 101 + salt) % (2**31 - 1)


def reduce_rollout_metrics(strategy: Strategy, metrics: dict[str, float]) -> dict[str, float]:
    """Mean over ranks; keys ending in ``_max`` take the max."""
    keys = sorted(metrics)
    mean_keys = [k for k in keys if not k.endswith("_max")]
    max_keys = [k for k in keys if k.endswith("_max")]
    world = strategy.runtime.world_size
    out = dict(zip(mean_keys, [v / world for v in strategy.all_reduce_sum([metrics[k] for k in mean_keys])])) if mean_keys else {}
    if max_keys:
        out.update(zip(max_keys, strategy.all_reduce_max([metrics[k] for k in max_keys])))
    return out


@dataclasses.dataclass(kw_only=True)
class TrainerState:
    step: int = 0
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    initial_eval: dict[str, float] = dataclasses.field(default_factory=dict)


class PPOTrainer:
    def __init__(
        self, *, cfg, strategy: Strategy, tokenizer, actor: TrainState, critic: TrainState | None,
        reference: torch.nn.Module | None, engine: RolloutEngine, engine_dtype: torch.dtype, reward_engine,
        algorithm: Algorithm, train_data: PromptDataset, eval_items: list[PromptItem], sampler: StatefulDistributedSampler,
        logger: MetricsLogger, timer: PhaseTimer, watchdog: Watchdog,
    ):
        self.cfg = cfg
        self.strategy = strategy
        self.rt = strategy.runtime
        self.tokenizer = tokenizer
        self.actor, self.critic, self.reference = actor, critic, reference
        self.engine, self.engine_dtype = engine, engine_dtype
        self.algo = algorithm
        self.train_data = train_data
        self.eval_items = eval_items
        self.sampler = sampler
        self.logger = logger
        self.timer = timer
        self.watchdog = watchdog
        self.state = TrainerState()
        self.ckpt_root = ckpt.checkpoint_root(cfg.run.output_dir)
        self.trajectories = TrajectoryWriter(Path(cfg.run.output_dir)) if self.rt.is_main else None
        self.maker = ExperienceMaker(
            strategy=strategy, actor=actor.model, critic=critic.model if critic else None, reference=reference,
            engine=engine, reward_engine=reward_engine, algorithm=algorithm, tokenizer=tokenizer,
            temperature=cfg.rollout.temperature, micro_batch_tokens=cfg.train.forward_micro_batch_tokens,
            micro_batch_max_seqs=cfg.train.forward_micro_batch_max_seqs, logprob_chunk_tokens=cfg.model.logprob_chunk_tokens,
            engine_sleep_level=cfg.engine.sleep_level, offload_reference=cfg.strategy.offload_reference,
            offload_critic=cfg.strategy.offload_critic,
            offload_actor=cfg.strategy.offload_actor_during_rollout,
            old_logprobs_pass=not cfg.reuses_policy_logprobs(), timer=timer,
        )
        self.updater = Updater(
            strategy=strategy, actor=actor, critic=critic, algorithm=algorithm, temperature=cfg.rollout.temperature,
            micro_batch_tokens=cfg.train.micro_batch_tokens, micro_batch_max_seqs=cfg.train.micro_batch_max_seqs,
            logprob_chunk_tokens=cfg.model.logprob_chunk_tokens, offload_optimizer=cfg.strategy.offload_optimizer,
            offload_critic=cfg.strategy.offload_critic,
        )

    # ---- one iteration ---------------------------------------------------------------------------
    def sampling_params(self, step: int, attempt: int = 0) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens, n=r.n_samples,
            ignore_eos=r.ignore_eos, seed=step_seed(self.cfg.run.seed, step, self.rt.rank, attempt),
        )

    def _next_items(self) -> tuple[list[PromptItem], int]:
        idx = self.sampler.next_batch()
        faults.hit("sampled", rank=self.rt.rank, data=idx)
        return [self.train_data[i] for i in idx], idx

    def collect(self, step: int) -> tuple[Experience, dict[str, float], list]:
        """Rollout + experience for one step, with DAPO dynamic sampling when configured: groups
        whose rewards have zero variance are dropped and more prompts are sampled until this rank
        has ``prompts_per_rank`` groups or ``max_tries`` rollouts were made (all ranks try equally often)."""
        per_rank = self.cfg.rollout.prompts_per_step // self.rt.world_size
        ds = self.algo.cfg.dynamic_sampling
        kept: list[Experience] = []
        kept_groups = 0
        metrics: dict[str, float] = {}
        samples_all: list = []
        tries = 0
        while True:
            items, idx = self._next_items()
            first_gid = step * 1_000_000 + tries * 10_000 + self.rt.rank * per_rank
            rollout = self.maker.generate(items, self.sampling_params(step, tries), first_gid)
            exp, m, samples = self.maker.make(rollout)
            tries += 1
            if not metrics:
                metrics, samples_all = m, samples
            if not ds.enabled:
                return exp, metrics, samples_all
            keep_B = self.algo.keep_groups(exp.rewards_B, exp.group_ids_B)
            gids = torch.unique(exp.group_ids_B[keep_B])
            take = gids[: per_rank - kept_groups]
            if len(take):
                kept.append(exp.select(torch.isin(exp.group_ids_B, take).nonzero().flatten().tolist()))
                kept_groups += len(take)
            done = float(kept_groups >= per_rank or tries >= ds.max_tries)
            if self.strategy.all_reduce_sum([1.0 - done])[0] == 0:  # every rank finished
                break
        metrics["dynamic_sampling/tries"] = float(tries)
        metrics["dynamic_sampling/kept_groups"] = float(kept_groups)
        metrics["dynamic_sampling/filled_frac"] = kept_groups / per_rank
        if not kept:  # nothing with signal: train on the last batch with its (zero) advantages
            kept = [exp]
        return concat_experiences(kept) if len(kept) > 1 else kept[0], metrics, samples_all

    def train_step(self, step: int) -> dict[str, float]:
        exp, rollout_metrics, samples = self.collect(step)
        metrics = reduce_rollout_metrics(self.strategy, rollout_metrics)
        gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, 0, salt=7))
        with self.timer.phase("train"):
            metrics.update(self.updater.train(exp, epochs=self.cfg.train.epochs, mini_batches=self.cfg.train.mini_batches, generator=gen))
        with self.timer.phase("weight_sync"):
            self.strategy.update_engine_weights(self.actor.model, self.engine, dtype=self.engine_dtype)
        if metrics.get("actor/skipped", 0.0) == 0.0:  # a skipped step changed nothing; its statistics may be NaN
            self.algo.update_after_step({k.split('/', 1)[1]: v for k, v in metrics.items() if k.startswith('actor/')})
        self._track_skips(metrics)
        metrics.update(self.timer.pop())
        metrics["time/step"] = sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/step")
        if self.strategy.device.type == "cuda":
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.strategy.device) / 2**30
            metrics["memory/reserved_gib"] = torch.cuda.memory_reserved(self.strategy.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.strategy.device)
        if self.trajectories is not None and self.cfg.logging.trajectories_due(step):
            self.trajectories.write(step, self._trajectory_records(samples, exp))
        return metrics

    def _track_skips(self, metrics: dict[str, float]) -> None:
        skipped = metrics.get("actor/skipped", 0.0) > 0
        self.state.skipped_total += int(skipped)
        self.state.skipped_in_a_row = self.state.skipped_in_a_row + 1 if skipped else 0
        metrics["actor/skipped_total"] = float(self.state.skipped_total)
        limit = self.cfg.train.max_skipped_steps_in_a_row
        if self.state.skipped_in_a_row >= limit:
            raise RuntimeError(
                f"{self.state.skipped_in_a_row} optimizer steps in a row had a non-finite gradient norm "
                f"(train.max_skipped_steps_in_a_row={limit}); lower optim.lr, check rewards for NaN/Inf"
            )

    def _trajectory_records(self, samples, exp: Experience) -> list[dict]:
        n = min(len(samples), len(exp))
        return [
            {
                "prompt": s.prompt, "response": s.response, "reference": s.reference,
                "reward": float(exp.rewards_B[i]), "finish_reason": s.finish_reason,
                "rollout_logprobs": exp.rollout_logp_BT[i][exp.action_mask_BT[i].bool()].tolist(),
            }
            for i, s in enumerate(samples[:n])
        ]

    # ---- evaluation / checkpoints ----------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        items = shard_items(self.eval_items, self.rt.rank, self.rt.world_size)
        with self.timer.phase("eval"):
            return evaluate(
                self.maker, items, self.cfg.eval, max_new_tokens=self.cfg.rollout.max_new_tokens,
                seed=step_seed(self.cfg.run.seed, step, self.rt.rank, salt=99),
            )

    def _model_states(self) -> dict:
        states = {"actor": self.strategy.state_dict(self.actor)}
        if self.critic is not None:
            states["critic"] = self.strategy.state_dict(self.critic)
        return states

    def save(self, step: int) -> None:
        trainer_state = {
            "step": step, "sampler": self.sampler.state_dict(), "algorithm": self.algo.state_dict(),
            "trainer": dataclasses.asdict(self.state),
        }
        with self.timer.phase("checkpoint"):
            ckpt.save_checkpoint(self.ckpt_root, step, model_states=self._model_states(), trainer_state=trainer_state,
                                 rank=self.rt.rank, keep=self.cfg.checkpoint.keep)

    def maybe_resume(self) -> int:
        if self.rt.is_main:
            ckpt.clean_partial(self.ckpt_root)
        self.strategy.barrier()
        path = ckpt.resolve_resume(self.cfg.checkpoint.resume, self.ckpt_root)
        if path is None:
            return 0
        states = self._model_states()
        st = ckpt.load_checkpoint(path, model_states=states, rank=self.rt.rank)
        self.strategy.load_state_dict(self.actor, states["actor"])
        if self.critic is not None:
            self.strategy.load_state_dict(self.critic, states["critic"])
        self.sampler.load_state_dict(st["sampler"])
        self.algo.load_state_dict(st["algorithm"])
        self.state = TrainerState(**st["trainer"])
        self.strategy.update_engine_weights(self.actor.model, self.engine, dtype=self.engine_dtype)
        if self.rt.is_main:
            print(f"[tidal] resumed from {path} (step {st['step']})", flush=True)
        return int(st["step"])

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Run to ``run.steps``; returns the final metrics (with start/end eval when configured)."""
        with self.watchdog.stage("resume"):
            start = self.maybe_resume()
        cfg = self.cfg
        if start == 0 and cfg.eval.at_start and self.eval_items:
            self.state.initial_eval = self.evaluate(0)
            self.timer.pop()
            self._announce("start", self.state.initial_eval)
        last: dict[str, float] = {}
        for step in range(start + 1, cfg.run.steps + 1):
            self.watchdog.set_step(step)
            metrics = self.train_step(step)
            final = step == cfg.run.steps
            if self.eval_items and ((cfg.eval.every and step % cfg.eval.every == 0) or (final and cfg.eval.at_end)):
                metrics.update(self.evaluate(step))
                metrics.update(self.timer.pop())
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or (final and cfg.checkpoint.at_end):
                self.save(step)
                metrics.update(self.timer.pop())
            self.logger.log(step, metrics)
            last = metrics
        if self.state.initial_eval and any(k.startswith("eval/") for k in last):
            self._announce("end", {k: v for k, v in last.items() if k.startswith("eval/")})
        self.logger.close()
        self.watchdog.close()
        return {**{f"initial_{k}": v for k, v in self.state.initial_eval.items()}, **last}

    def _announce(self, when: str, metrics: dict[str, float]) -> None:
        if self.rt.is_main:
            shown = ", ".join(f"{k.split('/', 1)[1]}={v:.4f}" for k, v in sorted(metrics.items()) if not math.isnan(v))
            print(f"[tidal] eval at {when}: {shown}", flush=True)
