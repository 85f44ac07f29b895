"""Configuration of the RL algorithm (``algorithm.*``): estimator, loss, KL, shaping, corrections.

Names (``advantage``, ``policy_loss``, ``loss_agg``, ``kl_estimator``) are validated against the
registries of :mod:`tidal.algorithms.registry`; combinations that cannot work, or settings that
would do nothing in the chosen combination, raise :class:`ConfigError` naming the key.
See ``docs/algorithms.md`` for the formula of each option.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.algorithms import advantages, aggregation, kl, losses, registry  # noqa: F401 (the first four register the variants)
from tidal.algorithms.kl import DEFAULT_KL_CLAMP
from tidal.config_base import check, check_choice


@dataclasses.dataclass(kw_only=True)
class MismatchConfig:
    """Rollout/trainer mismatch correction (``algorithm.mismatch.*``), truncated importance sampling.

    The weight is rho = pi_old / pi_rollout (trainer old logprobs vs the engine's sampling
    logprobs): per token, or per sequence (product over its response tokens).

    mode: ``none`` (metrics only), ``token_truncate`` (w = min(rho_t, cap)), ``token_mask``
        (w = rho_t, 0 where rho_t is outside [lower, cap]), ``seq_truncate``, ``seq_mask`` (same
        with the sequence ratio, applied to every token of the sequence).
    cap: upper threshold C >= 1. lower: lower threshold of the mask modes, in [0, 1).
    """

    mode: Literal["none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"] = "none"
    cap: float = 2.0
    lower: float = 0.0

    def __post_init__(self):
        check(self.cap >= 1.0, "cap", "must be >= 1")
        check(0.0 <= self.lower < 1.0, "lower", "must be in [0, 1)")
        check(self.lower == 0.0 or self.mode.endswith("_mask"), "lower", f"only used by the *_mask modes, not '{self.mode}'")
        check(self.cap == 2.0 or self.mode != "none", "cap", "only used when mode is not none (metrics only)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclasses.dataclass(kw_only=True)
class DynamicSamplingConfig:
    """DAPO dynamic sampling (``algorithm.dynamic_sampling.*``).

    enabled: drop prompt groups whose rewards all equal (zero variance: no learning signal) and let
        the trainer generate more until the batch is full.
    max_tries: most generation rounds per training batch (the first included); the trainer trains
        on what it has after that many and counts the rounds in its metrics.
    """

    enabled: bool = False
    max_tries: int = 3

    def __post_init__(self):
        check(self.max_tries >= 1, "max_tries", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class OverlongConfig:
    """DAPO overlong handling (``algorithm.overlong.*``).

    buffer_len: soft-penalty buffer L_cache (0: no shaping). A response of length L gets
        0 for L <= max_len - buffer_len, penalty_factor * (max_len - buffer_len - L) / buffer_len
        inside the buffer, and -penalty_factor beyond max_len.
    max_len: L_max, the generation budget in tokens (the sampler's max_new_tokens).
    penalty_factor: scale of the penalty (1 in DAPO).
    mask_truncated: exclude completions cut at the length limit from the loss
        (``Algorithm.loss_mask_B``).
    """

    buffer_len: int = 0
    max_len: int = 0
    penalty_factor: float = 1.0
    mask_truncated: bool = False

    def __post_init__(self):
        check(self.buffer_len >= 0, "buffer_len", "must be >= 0")
        check(self.max_len >= 0, "max_len", "must be >= 0")
        if self.buffer_len > 0:
            check(self.max_len > self.buffer_len, "max_len", "must be > buffer_len when overlong shaping is on")
        check(self.penalty_factor > 0, "penalty_factor", "must be > 0")

    @property
    def shaping(self) -> bool:
        return self.buffer_len > 0


@dataclasses.dataclass(kw_only=True)
class CPGDConfig:
    """CPGD settings (``algorithm.cpgd.*``).

    weight: advantage weighting of the ``cpgd`` estimator: ``std`` (A = (r - mean_g) / (std_g + eps)),
        ``equal`` (A = r - mean_g), ``clip_filter_like`` (A = min(G / G_valid, 3) (r - mean_g), G
        groups in the batch, G_valid those with non-zero reward variance).
    drift_coef: alpha of the policy-drift term alpha * KL(pi_old || pi) of the ``cpgd`` loss.
    """

    weight: Literal["std", "equal", "clip_filter_like"] = "std"
    drift_coef: float = 0.1

    def __post_init__(self):
        check(self.drift_coef >= 0, "drift_coef", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm (``algorithm.*``).

    advantage: estimator name: gae, grpo, dr_grpo, rloo, reinforce, reinforce_pp,
        reinforce_pp_baseline, cpgd.
    policy_loss: ppo_clip, gspo, gmpo, cispo, cpgd.
    loss_agg: token_mean, seq_mean_token_mean, seq_mean_token_sum, constant (Dr.GRPO).
    loss_agg_constant: the constant normaliser of ``constant`` (e.g. the generation budget).
    clip_low / clip_high: decoupled clip range [1 - clip_low, 1 + clip_high] of the ratio (DAPO
        clip-higher: clip_high > clip_low); GMPO clips the log-ratio to [-clip_low, clip_high];
        CISPO clips its IS weight with the same range (clip_low = 1: no lower bound).
    dual_clip: dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c * A
        (ppo_clip only; 0: off).
    distill_coef: weight of on-policy distillation (0: off): each sampled token's advantage gets
        ``distill_coef * (log pi_teacher(y_t) - log pi_student(y_t))``, the negative per-token reverse
        KL of the student against the teacher (``model.teacher``), added to the estimator's task
        advantages scaled by ``distill_task_weight``.
    distill_task_weight: weight of the task advantages when distilling (1: task rewards and the
        teacher together; 0: the teacher alone, while the rewards are still computed, logged and used
        for evaluation). Only with distill_coef > 0.
    kl_coef: KL coefficient beta (0: no KL and no reference model).
    kl_estimator: k1, k2 or k3 (Schulman's low-variance estimator).
    kl_clamp: each token's KL estimate is clamped to [-kl_clamp, kl_clamp] (10, as verl and
        OpenRLHF): a token far off the reference adds at most this much and no gradient past it.
        0: no clamp (log pi_ref - log pi is still bounded to [-20, 20], so k3 stays finite).
    kl_in_reward: False: beta * KL is a loss term; True: -beta * KL_t is added to each token's reward.
    kl_controller: ``fixed`` or ``adaptive`` (Ziegler et al. 2019; needs kl_target).
    kl_target: target per-token KL of the adaptive controller. kl_horizon_steps: its horizon in
        ``update_after_step`` calls (Ziegler's horizon in samples / samples per call).
    gamma / lam: discount and GAE lambda. value_clip: value-loss clip range (0: unclipped).
    value_loss_coef: weight of the critic loss. entropy_coef: entropy bonus weight.
    entropy_top_q: fraction q of highest-entropy response tokens of a micro-batch that receive the
        policy gradient (1: all tokens; 0.2 in Wang et al. 2025).
    reward_norm: ``running``: rewards standardised with running moments over steps; ``none``.
    reward_clip: clip rewards to [-c, c] after normalisation (0: off).
    adv_norm: ``batch`` (whiten over the batch's response tokens), ``running`` (running moments),
        ``none``. adv_clip: clip advantages to [-c, c] after normalisation (0: off).
    """

    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    loss_agg: str = "token_mean"
    loss_agg_constant: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    kl_coef: float = 0.0
    distill_coef: float = 0.0
    distill_task_weight: float = 1.0
    kl_estimator: str = "k3"
    kl_clamp: float = DEFAULT_KL_CLAMP
    kl_in_reward: bool = False
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = 0.0
    kl_horizon_steps: int = 20
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    value_loss_coef: float = 0.5
    entropy_coef: float = 0.0
    entropy_top_q: float = 1.0
    reward_norm: Literal["none", "running"] = "none"
    reward_clip: float = 0.0
    adv_norm: Literal["none", "batch", "running"] = "none"
    adv_clip: float = 0.0
    mismatch: MismatchConfig = dataclasses.field(default_factory=MismatchConfig)
    dynamic_sampling: DynamicSamplingConfig = dataclasses.field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    cpgd: CPGDConfig = dataclasses.field(default_factory=CPGDConfig)

    def __post_init__(self):
        check_choice(self.advantage, registry.ADVANTAGE_ESTIMATORS.names(), "advantage")
        check_choice(self.policy_loss, registry.POLICY_LOSSES.names(), "policy_loss")
        check_choice(self.loss_agg, registry.LOSS_AGGREGATORS.names(), "loss_agg")
        check_choice(self.kl_estimator, registry.KL_ESTIMATORS.names(), "kl_estimator")
        self._check_loss()
        self._check_kl()
        self._check_estimator()
        self._check_shaping()

    def _check_loss(self):
        loss = registry.POLICY_LOSSES.get(self.policy_loss, "policy_loss")
        if self.loss_agg == "constant":
            check(self.loss_agg_constant > 0, "loss_agg_constant", "must be > 0 with loss_agg=constant")
        else:
            check(self.loss_agg_constant == 0, "loss_agg_constant", f"only used by loss_agg=constant, not '{self.loss_agg}'")
        check(self.clip_low >= 0, "clip_low", "must be >= 0")
        check(self.clip_high > 0, "clip_high", "must be > 0")
        if loss.ratio_clip:
            check(self.clip_low < 1, "clip_low", f"must be < 1 for {self.policy_loss} (the lower bound 1 - clip_low must be > 0)")
        if loss.weight_clip:
            check(self.clip_low <= 1, "clip_low", f"must be <= 1 for {self.policy_loss} (1: no lower bound on the IS weight)")
        check(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", "must be 0 (off) or > 1")
        check(self.dual_clip == 0 or loss.dual_clip, "dual_clip", f"does not apply to policy_loss={self.policy_loss} (only to ppo_clip)")
        check(self.value_clip >= 0, "value_clip", "must be >= 0 (0: unclipped)")
        check(self.value_loss_coef >= 0, "value_loss_coef", "must be >= 0")
        check(self.entropy_coef >= 0, "entropy_coef", "must be >= 0")
        check(0 < self.entropy_top_q <= 1, "entropy_top_q", "must be in (0, 1]")
        if loss.sequence_ratio:
            # Their ratio couples all tokens of a sequence: a per-token weight cannot select tokens.
            check(self.entropy_top_q == 1, "entropy_top_q", f"token selection does not apply to the sequence-level {self.policy_loss}")
            check(not self.mismatch.mode.startswith("token_"), "mismatch.mode", f"{self.policy_loss} has a sequence-level ratio: use seq_truncate or seq_mask")

    def _check_kl(self):
        check(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        check(self.distill_coef >= 0, "distill_coef", "must be >= 0 (0: no distillation)")
        check(self.distill_task_weight >= 0, "distill_task_weight", "must be >= 0")
        check(self.distill_coef > 0 or self.distill_task_weight == 1.0, "distill_task_weight",
              "only applies with distill_coef > 0 (on-policy distillation)")
        check(self.kl_clamp >= 0, "kl_clamp", "must be >= 0 (0: no clamp)")
        check(self.kl_coef > 0 or self.kl_clamp == DEFAULT_KL_CLAMP, "kl_clamp", "only used with kl_coef > 0 (no KL is computed)")
        check(not self.kl_in_reward or self.kl_coef > 0, "kl_in_reward", "needs kl_coef > 0")
        if self.kl_controller == "adaptive":
            check(self.kl_coef > 0, "kl_controller", "adaptive needs kl_coef > 0 (its initial value)")
            check(self.kl_target > 0, "kl_target", "must be > 0 with kl_controller=adaptive")
        else:
            check(self.kl_target == 0, "kl_target", "only used by kl_controller=adaptive")
        check(self.kl_horizon_steps >= 1, "kl_horizon_steps", "must be >= 1")
        if self.kl_controller != "adaptive":
            check(self.kl_horizon_steps == _DEFAULTS["kl_horizon_steps"], "kl_horizon_steps", "only used by kl_controller=adaptive")
        if self.kl_coef == 0:
            check(self.kl_estimator == _DEFAULTS["kl_estimator"], "kl_estimator", "only used with kl_coef > 0 (no KL is computed)")

    def _check_estimator(self):
        estimator = registry.ADVANTAGE_ESTIMATORS.get(self.advantage, "advantage")
        check(0 <= self.gamma <= 1, "gamma", "must be in [0, 1]")
        check(0 <= self.lam <= 1, "lam", "must be in [0, 1]")
        if not estimator.discounts:
            check(self.gamma == 1.0, "gamma", f"must be 1 for advantage={self.advantage} (it does not discount)")
        if estimator.needs_critic:
            check(self.value_loss_coef > 0, "value_loss_coef", f"{self.advantage} trains a critic: must be > 0")
        else:  # settings of the critic and of GAE, which this estimator does not have
            for name in ("lam", "value_clip", "value_loss_coef"):
                check(getattr(self, name) == _DEFAULTS[name], name, f"only used by estimators with a critic (gae), not advantage={self.advantage}")
        if estimator.whitens_batch:
            check(self.adv_norm != "batch", "adv_norm", f"advantage={self.advantage} already whitens over the batch")
        check(self.reward_clip >= 0, "reward_clip", "must be >= 0 (0: off)")
        check(self.adv_clip >= 0, "adv_clip", "must be >= 0 (0: off)")

    def _check_shaping(self):
        if not self.dynamic_sampling.enabled:
            check(self.dynamic_sampling.max_tries == DynamicSamplingConfig().max_tries, "dynamic_sampling.max_tries",
                  "only used when dynamic_sampling.enabled is true")
        if not self.overlong.shaping:
            for name in ("penalty_factor", "max_len"):
                check(getattr(self.overlong, name) == getattr(OverlongConfig(), name), f"overlong.{name}",
                      "only used by overlong shaping (overlong.buffer_len > 0)")
        default = CPGDConfig()
        if self.cpgd.weight != default.weight:
            check(self.advantage == "cpgd", "cpgd.weight", f"only used by advantage=cpgd, not '{self.advantage}'")
        if self.cpgd.drift_coef != default.drift_coef:
            check(self.policy_loss == "cpgd", "cpgd.drift_coef", f"only used by policy_loss=cpgd, not '{self.policy_loss}'")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig) if f.default is not dataclasses.MISSING}
