"""Configuration of the run, rollout, training loop and evaluation."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

from tidal.config_base import check
from tidal.envs.config import EnvConfig
from tidal.logging.config import LoggingConfig
from tidal.models.config import ModelConfig
from tidal.rewards.config import RewardConfig
from tidal.sampling_filter import SamplingFilter
from tidal.run.config import CheckpointConfig
from tidal.strategy.config import OptimConfig, StrategyConfig
from tidal.sync.config import SyncConfig

# request id = group id * SAMPLE_SLOTS + sample index (unique among the partial rollout's requests in flight)
SAMPLE_SLOTS = 1024


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """output_dir: the run directory (metrics, checkpoints, trajectories, report).
    steps: RL iterations (rollout + update) to run. seed: seeds data order, sampling and init
        (0 <= seed < 2**63).
    device: ``auto`` (CUDA if available), ``cuda`` or ``cpu``.
    collective_timeout_s: how long a rank waits in a collective before the run fails with the stage named.
    cpu_threads: torch's intra-op threads per rank when the run computes on CPU. 0 (default):
        ``OMP_NUM_THREADS`` when set, else half of the rank's share of the usable cores, at least 1
        (:func:`tidal.distributed.runtime.cpu_threads` says why). Unused on CUDA.
    """

    output_dir: str = "runs/default"
    steps: int = 100
    seed: int = 1
    device: Literal["auto", "cuda", "cpu"] = "auto"
    collective_timeout_s: float = 1800.0
    cpu_threads: int = 0

    def __post_init__(self):
        check(bool(self.output_dir), "output_dir", "must be set")
        check(self.steps >= 1, "steps", "must be >= 1")
        check(self.seed >= 0, "seed", "must be >= 0")
        check(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0")
        check(self.cpu_threads >= 0, "cpu_threads", "must be >= 0 (0: the rule in docs, or OMP_NUM_THREADS)")


@dataclasses.dataclass(kw_only=True)
class PartialRolloutConfig:
    """Long-tail handling of training rollouts (``rollout.partial.*``; docs/partial_rollout.md).
    Each rank keeps prompt groups in flight, G being its share of ``rollout.prompts_per_step``; a
    rollout stops as soon as G groups are complete (all their ``n_samples`` sequences finished) and,
    in ``carry``, every *due* group is complete too (one that could not be trained later without a
    token lagging more than ``max_staleness``); G groups are trained.

    mode: ``off`` (plain rollout: every group runs to its end). ``carry`` (partial rollout across
        iterations): the unfinished sequences (tokens, sampling logprobs, policy versions) and the
        complete groups beyond G are kept, checkpointed, and resumed first in the next rollout under
        the new weights (re-prefilled); new prompts refill the in-flight groups, so after the first
        step each rollout takes G new prompts. Needs an ``algorithm.mismatch.mode`` (stale tokens
        were sampled by older weights: the correction weights them by pi_old / pi_rollout).
        ``drop`` (over-sample, drop the slowest): the groups that are not among the first G complete
        are aborted and discarded (biased towards short responses; nothing is stale).
    oversample: extra groups in flight as a fraction of G: a number >= 0 keeps
        ``ceil(G * (1 + oversample))`` in flight (0 cuts nothing: every group in flight completes,
        which is exactly a plain rollout). ``auto``: ``carry`` starts with ``ceil(1.5 G)`` and sizes
        it from the observed tail after every rollout (more groups when the rollout had to wait for
        complete groups, fewer when it had many to spare; between G and ``G * (max_staleness + 2)``,
        ``partial/in_flight``); ``drop`` keeps ``ceil(1.5 G)``.
    max_staleness: ``carry`` only: the most policy versions a trained token may lag behind the
        weights it is trained with. A group in its last allowed rollout is due: the rollout goes on
        until it is complete, so a sequence spans at most ``max_staleness + 1`` rollouts and
        no work is thrown away. A carried group whose oldest token would still lag more (a complete
        group that found no place in a batch in time) is restarted from its prompt (counted in
        ``partial/restarted``). 0: every group is due in the rollout that starts it.
    """

    mode: Literal["off", "carry", "drop"] = "off"
    oversample: Literal["auto"] | float = "auto"
    max_staleness: int = 4

    def __post_init__(self):
        check(self.oversample == "auto" or self.oversample >= 0, "oversample", "must be 'auto' or a number >= 0")
        check(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        check(self.mode != "off" or self.oversample == "auto", "oversample", "only used when mode is carry or drop")
        check(self.mode == "carry" or self.max_staleness == 4, "max_staleness", f"only used when mode is carry, not '{self.mode}'")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """prompts_per_step: prompts per iteration over ALL ranks (must divide by WORLD_SIZE).
    n_samples: responses per prompt (the group size of GRPO-family estimators).
    temperature/top_p/top_k/min_p: the processed distribution sampled from (:mod:`tidal.sampling_filter`:
        temperature, top-k, min-p, top-p, renormalised; 1.0/0/0 disable the filters). The trainer's
        logprobs (old, reference, and the update's) are of the same distribution (:attr:`filter`),
        so the rollout-vs-trainer ratio is 1 where the weights agree.
    max_new_tokens: response length limit (longer responses are truncated, finish_reason=length).
    ignore_eos: never stop at EOS, always generate max_new_tokens (benchmarks with random models).
    partial: long-tail handling, partial rollout across iterations or drop-the-slowest
        (:class:`PartialRolloutConfig`).
    """

    prompts_per_step: int = 16
    n_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    ignore_eos: bool = False
    partial: PartialRolloutConfig = dataclasses.field(default_factory=PartialRolloutConfig)

    def __post_init__(self):
        check(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        check(self.n_samples >= 1, "n_samples", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0 for RL sampling (use eval.greedy for greedy evaluation)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be >= 0")
        check(0 <= self.min_p < 1, "min_p", "must be in [0, 1) (0 disables)")
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")

    @property
    def filter(self) -> SamplingFilter:
        """The processed distribution the engine samples from and the trainer scores with."""
        return SamplingFilter(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """epochs: passes over each rollout batch. mini_batches: optimizer steps per epoch (the rollout
    is split into this many equal mini-batches of whole prompt groups).
    micro_batch_tokens / micro_batch_max_seqs: budget of one forward/backward in real tokens (sequences
        are packed without padding and never split, so it must hold the longest sequence,
        data.max_prompt_len + rollout.max_new_tokens). ``auto`` (default): the memory plan
        (``memory.*``) picks the largest budget whose update phase fits the device, at least the
        longest sequence and at most one rank's mini-batch; 16384 (raised to the longest sequence)
        where no plan is made (a CPU run without ``memory.device_memory_gib``, the reward-model job).
        An explicit number is kept and checked against the plan.
    forward_micro_batch_tokens / forward_micro_batch_max_seqs: the same for the no-grad forwards of
        the experience (old and reference logprobs, critic values, the teacher's logprobs). They
        keep no activations, so their budget can be several times the training one: fewer, larger
        passes. ``auto`` (default): the largest that fits, at most 65536; 65536 where no plan is made.
    max_skipped_steps_in_a_row: optimizer steps with a non-finite gradient norm are skipped on all
        ranks and counted; this many in a row stops the run with an error.
    old_logprobs: where the PPO ratio's denominator comes from. ``auto``: when each rollout gets
        exactly one optimizer step (epochs 1, mini_batches 1) and no KL enters the reward, the actor
        is unchanged between the rollout and its update, so the update's own forward gives the old
        logprobs (detached: ratio 1, the same gradient) and the separate no-grad pass is skipped, as
        TRL does for ``num_iterations=1`` (see ``Algorithm.reuses_policy_logprobs``); otherwise the
        pass runs. ``recompute``: always run the pass.
    """

    epochs: int = 1
    mini_batches: int = 1
    micro_batch_tokens: Literal["auto"] | int = "auto"
    micro_batch_max_seqs: int = 64
    forward_micro_batch_tokens: Literal["auto"] | int = "auto"
    forward_micro_batch_max_seqs: int = 256
    max_skipped_steps_in_a_row: int = 3
    old_logprobs: Literal["auto", "recompute"] = "auto"

    def __post_init__(self):
        check(self.epochs >= 1, "epochs", "must be >= 1")
        check(self.mini_batches >= 1, "mini_batches", "must be >= 1")
        check(self.micro_batch_tokens == "auto" or self.micro_batch_tokens >= 1, "micro_batch_tokens", "must be >= 1 or auto")
        check(self.micro_batch_max_seqs >= 1, "micro_batch_max_seqs", "must be >= 1")
        check(self.forward_micro_batch_tokens == "auto" or self.forward_micro_batch_tokens >= 1, "forward_micro_batch_tokens",
              "must be >= 1 or auto")
        check(self.forward_micro_batch_max_seqs >= 1, "forward_micro_batch_max_seqs", "must be >= 1")
        check(self.max_skipped_steps_in_a_row >= 1, "max_skipped_steps_in_a_row", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    """every: evaluate every N steps (0: never during training) and at the end when > 0 or at_end.
    greedy: one greedy response per prompt (accuracy); n_samples > 0 adds sampled pass@k / mean@k.
    max_prompts: evaluate on at most this many eval prompts (0: all).
    correct_threshold: a response counts as correct when its total reward is >= this. Accuracy
        (``eval/greedy_accuracy``, ``eval/pass@k``) is reported only when every reward component is
        a rule or a function; with a reward model or a remote service among them the total reward
        is a score, not a judgement, and evaluation reports the mean reward (``eval/greedy_reward``,
        ``eval/mean@k``) only.
    """

    every: int = 0
    at_end: bool = True
    at_start: bool = True
    greedy: bool = True
    n_samples: int = 0
    temperature: float = 1.0
    max_prompts: int = 0
    correct_threshold: float = 1.0

    def __post_init__(self):
        check(self.every >= 0, "every", "must be >= 0")
        check(self.n_samples >= 0, "n_samples", "must be >= 0")
        check(self.greedy or self.n_samples > 0, "greedy", "evaluation needs greedy: true or n_samples > 0")
        check(self.temperature > 0, "temperature", "must be > 0")
        check(self.n_samples > 0 or self.temperature == 1.0, "temperature", "only used by sampled evaluation (n_samples > 0)")
        check(self.max_prompts >= 0, "max_prompts", "must be >= 0")


class TrainerSections(Protocol):
    """The config sections the RL loop reads (the root ``TidalConfig`` has them all); each component
    of the loop is handed the sections it reads, under their YAML names."""

    run: RunConfig
    model: ModelConfig
    sync: SyncConfig
    rollout: RolloutConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    strategy: StrategyConfig
    optim: OptimConfig
    env: EnvConfig
    reward: RewardConfig


def require_resolved(section: Any, key: str, *names: str) -> None:
    """A ValueError when a field ``names`` of ``section`` (the ``key`` section of the config) is
    still ``auto``: the memory plan decides those, once, at setup, and a component must be handed
    the resolved section (:meth:`tidal.memory.plan.MemorySettings.run_config`, or
    :func:`~tidal.memory.plan.settings_without_plan` where no plan is made)."""
    for name in names:
        if getattr(section, name) == "auto":
            raise ValueError(f"{key}.{name} is 'auto': build this component from the config resolved by the memory plan "
                             "(MemorySettings.run_config), not from the config as written")


def check_partial_rollout(cfg: Any) -> None:
    """Cross-section checks of ``rollout.partial`` (``cfg``: the root ``TidalConfig``)."""
    p = cfg.rollout.partial
    if not p.enabled:
        return
    key = "rollout.partial.mode"
    check(cfg.engine.backend == "native", key, f"{p.mode} needs an engine with incremental requests (add/step/abort): "
          f"set engine.backend=native (got {cfg.engine.backend!r}) or rollout.partial.mode=off")
    check(cfg.env.name == "single_turn", key, f"{p.mode} applies to single-turn rollouts; env.name is {cfg.env.name!r}: "
          f"set rollout.partial.mode=off")
    check(not cfg.algorithm.dynamic_sampling.enabled, key,
          f"{p.mode} does not combine with algorithm.dynamic_sampling (both decide which groups a batch takes); turn one off")
    check(cfg.rollout.n_samples <= SAMPLE_SLOTS, key, f"supports rollout.n_samples <= {SAMPLE_SLOTS}")
    if p.mode == "carry":
        check(cfg.algorithm.mismatch.enabled, key,
              "carry trains tokens sampled by older weights: set algorithm.mismatch.mode (token_truncate, token_mask, "
              "seq_truncate or seq_mask) so that they are weighted by pi_old / pi_rollout")
