"""``Algorithm``: the one object the trainer talks to; it wires the configured variants together.

What the trainer asks and calls, per run and per iteration (see docs/algorithms.md, "Trainer contract"):
 0. what to build:     algo.needs_critic, algo.needs_reference, algo.reuses_policy_logprobs(train)
 1. rollout rounds:    algo.sampling_rounds (1, or DAPO dynamic sampling's max tries); after each
                       round keep_B = algo.keep_groups(rewards_B, group_ids_B) (all True when off)
 2. after scoring:     out = algo.advantages(total_B=..., ...) -> AdvantageResult (reward shaping,
                       KL in the reward when configured, the estimator, normalisation)
 3. truncation mask:   mask_B = algo.loss_mask_B(truncated_B) (before counting the LossNormalizer)
 4. per micro-batch:   loss, m = algo.policy_loss(...); loss_v, m_v = algo.value_loss(...)
 5. after the updates of the iteration: algo.update_after_step(actor_metrics) (the policy update's
                       own metrics, as policy_loss and the optimizer step named them)
It does not know models, devices or the data layout beyond the [B, T] tensors it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol

from tidal.algorithms import registry
from tidal.algorithms.aggregation import local_loss_metric, token_mean_metric
from tidal.algorithms.base import AdvantageInput, LossNormalizer
from tidal.algorithms.config import AlgorithmConfig
from tidal.algorithms.entropy import top_entropy_mask_BT
from tidal.algorithms.kl import make_kl_controller
from tidal.algorithms.mismatch import mismatch_weights
from tidal.algorithms.normalization import RunningMoments, masked_whiten
from tidal.algorithms.shaping import nonzero_variance_groups_B, overlong_penalty_B
from tidal.algorithms.trajectory_rows import merge_rows, split_rows
from tidal.lazy import lazy_module

torch = lazy_module("torch")


class UpdateSchedule(Protocol):
    """How often the policy is updated per rollout (``train.*``): what :meth:`Algorithm.reuses_policy_logprobs` reads."""

    epochs: int
    mini_batches: int
    old_logprobs: str


@dataclasses.dataclass(kw_only=True)
class AdvantageResult:
    """What :meth:`Algorithm.advantages` gives the experience: shaped scalar rewards, per-token
    advantages and returns (zero off the action mask), the per-token KL to the reference (when both
    old and reference logprobs exist; for metrics) and reward metrics."""

    rewards_B: torch.Tensor
    advantages_BT: torch.Tensor
    returns_BT: torch.Tensor
    kl_BT: torch.Tensor | None
    metrics: dict[str, float]


def _first_rows(trajectory_ids_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each trajectory [N], index of each row's trajectory among them [B])."""
    _, row_to_N = torch.unique(trajectory_ids_B, return_inverse=True)
    B = trajectory_ids_B.shape[0]
    first_N = torch.full((int(row_to_N.max()) + 1 if B else 0,), B, dtype=torch.long)
    first_N = first_N.scatter_reduce(0, row_to_N, torch.arange(B), reduce="amin")
    return first_N, row_to_N


class Algorithm:
    """The configured RL algorithm.

    group: process group (reducing CPU tensors, e.g. gloo) over which batch statistics (running
        moments, batch whitening) are all-reduced; None keeps them local to this process's batch.
        With a group, every rank must make the same calls (process_rewards, compute_advantages). Prompt groups (group_ids_B)
        must never be split across ranks.
    """

    def __init__(self, cfg: AlgorithmConfig, *, group=None):
        self.cfg = cfg
        self.group = group
        self.estimator = registry.ADVANTAGE_ESTIMATORS.get(cfg.advantage, "algorithm.advantage")(cfg, group)
        self.pg_loss = registry.POLICY_LOSSES.get(cfg.policy_loss, "algorithm.policy_loss")(cfg)
        self.agg = registry.LOSS_AGGREGATORS.get(cfg.loss_agg, "algorithm.loss_agg")(cfg)
        self.kl = registry.KL_ESTIMATORS.get(cfg.kl_estimator, "algorithm.kl_estimator")(clamp=cfg.kl_clamp)
        self.kl_ctl = make_kl_controller(cfg)
        self.reward_moments = RunningMoments()
        self.adv_moments = RunningMoments()

    # ---- what to build -------------------------------------------------------------------
    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """On-policy distillation is on: the experience needs the teacher's logprobs of the sampled tokens."""
        return self.cfg.distill_coef > 0

    @property
    def entropy_needs_grad(self) -> bool:
        """The loss differentiates through entropy_BT (an entropy bonus); a top-q mask does not."""
        return self.cfg.entropy_coef > 0

    def reuses_policy_logprobs(self, train: UpdateSchedule) -> bool:
        """True when the update's own forward supplies the actor's old logprobs, so the experience
        skips its no-grad actor pass: ``train.old_logprobs: auto`` with exactly one optimizer step
        per rollout (the actor has not moved since the rollout, ratio 1, the same gradient) and no KL
        in the reward (which needs them before the update)."""
        one_step = train.epochs * train.mini_batches == 1
        return train.old_logprobs == "auto" and one_step and not self.cfg.kl_in_reward

    @property
    def sampling_rounds(self) -> int:
        """Most rollouts per iteration: DAPO dynamic sampling's ``max_tries``, else 1."""
        ds = self.cfg.dynamic_sampling
        return ds.max_tries if ds.enabled else 1

    @property
    def kl_coef(self) -> float:
        """The current KL coefficient beta (changes under the adaptive controller)."""
        return self.kl_ctl.value

    # ---- rollout side --------------------------------------------------------------------
    def process_rewards(
        self, rewards_B: torch.Tensor, group_ids_B: torch.Tensor, response_len_B: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Overlong shaping, then running normalisation, then clipping, each only when configured.

        Metrics (Python floats) are means over this batch: overlong_penalty (shaping on),
        reward_clip_frac (clipping on); the rewards and the truncated fraction before processing are
        the rollout's (``reward/mean``, ``response/truncated_frac``). group_ids_B is accepted for
        symmetry with keep_groups.
        """
        del group_ids_B
        rewards_B = rewards_B.to(torch.float32)
        metrics: dict[str, float] = {}
        cfg = self.cfg
        if cfg.overlong.shaping:
            penalty_B = overlong_penalty_B(response_len_B, cfg.overlong)
            rewards_B = rewards_B + penalty_B
            metrics["overlong_penalty"] = float(penalty_B.mean())
        if cfg.reward_norm == "running":
            self.reward_moments.update(rewards_B, group=self.group)
            rewards_B = self.reward_moments.normalize(rewards_B)
        if cfg.reward_clip > 0:
            metrics["reward_clip_frac"] = float((rewards_B.abs() > cfg.reward_clip).float().mean())
            rewards_B = rewards_B.clamp(-cfg.reward_clip, cfg.reward_clip)
        return rewards_B, metrics

    def keep_groups(self, rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
        """DAPO dynamic sampling: False for every sample of a group whose rewards are all equal."""
        if not self.cfg.dynamic_sampling.enabled:
            return torch.ones_like(rewards_B, dtype=torch.bool)
        return nonzero_variance_groups_B(rewards_B, group_ids_B)

    def loss_mask_B(self, truncated_B: torch.Tensor) -> torch.Tensor:
        """1.0 for samples that enter the loss; 0.0 for truncated ones when overlong.mask_truncated."""
        keep_B = torch.ones_like(truncated_B, dtype=torch.float32)
        if self.cfg.overlong.mask_truncated:
            keep_B = keep_B * (~truncated_B.bool()).float()
        return keep_B

    def token_kl(self, logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
        return self.kl(logp_BT, ref_logp_BT)

    def kl_reward_BT(self, logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """-beta * KL_t on response tokens: AdvantageInput.token_rewards_BT when kl_in_reward."""
        return -self.kl_coef * self.token_kl(logp_BT.detach(), ref_logp_BT.detach()) * mask_BT

    def compute_advantages(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator's (adv_BT, ret_BT), then advantage normalisation and clipping when configured
        (returns are left as the estimator made them). With ``inp.trajectory_ids_B`` the estimator
        sees each trajectory's rows laid end to end (:mod:`tidal.algorithms.trajectory_rows`)."""
        if inp.trajectory_ids_B is not None:
            merged, layout = merge_rows(inp)
            adv_NT, ret_NT = self.estimator.compute(merged)
            adv_BT, ret_BT = split_rows(adv_NT, layout), split_rows(ret_NT, layout)
        else:
            adv_BT, ret_BT = self.estimator.compute(inp)
        mask = inp.action_mask_BT.to(adv_BT.dtype)
        if self.cfg.adv_norm == "batch":
            adv_BT = masked_whiten(adv_BT, mask, self.group)
        elif self.cfg.adv_norm == "running":
            self.adv_moments.update(adv_BT, mask, group=self.group)
            adv_BT = self.adv_moments.normalize(adv_BT) * mask
        if self.cfg.adv_clip > 0:
            adv_BT = adv_BT.clamp(-self.cfg.adv_clip, self.cfg.adv_clip)
        return adv_BT, ret_BT

    def advantages(
        self, *, total_B: torch.Tensor, action_mask_BT: torch.Tensor, group_ids_B: torch.Tensor,
        truncated_B: torch.Tensor, old_logp_BT: torch.Tensor | None, ref_logp_BT: torch.Tensor | None,
        values_BT: torch.Tensor | None, student_logp_BT: torch.Tensor | None = None,
        teacher_logp_BT: torch.Tensor | None = None, token_rewards_BT: torch.Tensor | None = None,
        trajectory_ids_B: torch.Tensor | None = None, response_len_B: torch.Tensor | None = None,
    ) -> AdvantageResult:
        """Reward processing, the KL to the reference (in the reward when ``kl_in_reward``) and the
        estimator's advantages/returns for one rollout batch (see :meth:`process_rewards`,
        :meth:`kl_reward_BT`, :meth:`compute_advantages`); with distillation on, the advantages are
        ``distill_task_weight * task advantages + distill term`` (:meth:`distill_advantage_BT`;
        ``student_logp_BT``: the student's logprobs of the sampled tokens; ``teacher_logp_BT``: the
        teacher's); returns (a critic's targets) stay the task's.

        Multi-turn trajectories (:mod:`tidal.envs`): ``token_rewards_BT`` holds per-turn rewards
        (each at the last sampled token of its turn), added to the KL token rewards;
        ``trajectory_ids_B`` (trajectories split over rows, ``AdvantageInput.trajectory_ids_B``)
        makes reward processing see each trajectory once (its first row stands for it; the rows of
        one trajectory must share ``total_B``, ``truncated_B`` and ``response_len_B``);
        ``response_len_B`` is the length the overlong shaping reads (default: the row's sampled tokens).
        """
        if response_len_B is None:
            response_len_B = action_mask_BT.sum(-1)
        if trajectory_ids_B is None:
            rewards_B, metrics = self.process_rewards(total_B, group_ids_B, response_len_B)
        else:
            first_N, row_to_N = _first_rows(trajectory_ids_B)
            rewards_N, metrics = self.process_rewards(total_B[first_N], group_ids_B[first_N], response_len_B[first_N])
            rewards_B = rewards_N[row_to_N]
        kl_BT = None
        if self.cfg.kl_in_reward and old_logp_BT is None:
            raise ValueError("algorithm.kl_in_reward needs the actor's old logprobs before the update: run their pass")
        if ref_logp_BT is not None and old_logp_BT is not None:
            kl_BT = self.token_kl(old_logp_BT, ref_logp_BT) * action_mask_BT
            if self.cfg.kl_in_reward:
                kl_reward_BT = self.kl_reward_BT(old_logp_BT, ref_logp_BT, action_mask_BT)
                token_rewards_BT = kl_reward_BT if token_rewards_BT is None else token_rewards_BT + kl_reward_BT
        adv_BT, ret_BT = self.compute_advantages(
            AdvantageInput(
                rewards_B=rewards_B, action_mask_BT=action_mask_BT, group_ids_B=group_ids_B,
                token_rewards_BT=token_rewards_BT, values_BT=values_BT, trajectory_ids_B=trajectory_ids_B,
            )
        )
        if self.needs_teacher:
            if teacher_logp_BT is None or student_logp_BT is None:
                raise ValueError("algorithm.distill_coef > 0: advantages needs the student's and the teacher's logprobs")
            distill_BT = self.distill_advantage_BT(student_logp_BT, teacher_logp_BT, action_mask_BT)
            adv_BT = self.cfg.distill_task_weight * adv_BT + distill_BT
            mask = action_mask_BT.to(torch.float32)
            ntok = mask.sum().clamp_min(1)
            metrics["distill/reverse_kl"] = float(((student_logp_BT - teacher_logp_BT) * mask).sum() / ntok)
            metrics["distill/advantage_mean"] = float(distill_BT.sum() / ntok)
        return AdvantageResult(
            rewards_B=rewards_B, advantages_BT=adv_BT * action_mask_BT, returns_BT=ret_BT * action_mask_BT,
            kl_BT=kl_BT, metrics=metrics,
        )

    def distill_advantage_BT(self, student_logp_BT: torch.Tensor, teacher_logp_BT: torch.Tensor,
                             mask_BT: torch.Tensor) -> torch.Tensor:
        """On-policy distillation's per-token advantage: ``distill_coef * (log pi_T(y_t) - log pi_S(y_t))``
        on sampled tokens, the negative single-sample estimate of the reverse KL(pi_S || pi_T) at token t
        (Agarwal et al. 2024, GKD with on-policy samples; Lu & Thinking Machines 2025). It is not
        discounted, normalised or group-centred: each token is pushed towards the teacher by how much
        more likely the teacher finds it."""
        return self.cfg.distill_coef * (teacher_logp_BT - student_logp_BT).detach() * mask_BT

    # ---- training side -------------------------------------------------------------------
    def policy_loss(
        self,
        logp_BT: torch.Tensor,
        old_logp_BT: torch.Tensor,
        adv_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        norm: LossNormalizer,
        *,
        ref_logp_BT: torch.Tensor | None = None,
        rollout_logp_BT: torch.Tensor | None = None,
        entropy_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's loss share of one micro-batch and its metric shares.

        loss = policy term (IS-weighted; weight 0 off the top-entropy tokens when entropy_top_q < 1)
             + beta * agg(KL) (kl_coef > 0 and not kl_in_reward) - entropy_coef * agg(H).
        Metrics are detached means over THIS micro-batch (per-token ones over its response tokens;
        loss, pg_loss and kl_loss are the micro-batch's own aggregate, as if it were the whole
        batch): their mean over micro-batches and ranks weighted by response-token count is the
        global value (exactly, for per-token metrics and token_mean). Keys: loss, pg_loss,
        clip_frac, approx_kl, kl (ref given), kl_loss, entropy (entropy given), mismatch_*
        (rollout logprobs given), entropy_selected_frac (entropy_top_q < 1), dual_clip_frac.
        """
        mask = mask_BT.to(logp_BT.dtype)
        weight_BT, metrics = None, {}
        if rollout_logp_BT is not None:
            weight_BT, metrics = mismatch_weights(old_logp_BT, rollout_logp_BT, mask, self.cfg.mismatch)
        elif self.cfg.mismatch.enabled:
            raise ValueError("algorithm.mismatch is on: policy_loss needs rollout_logp_BT")
        if self.cfg.entropy_top_q < 1:
            if entropy_BT is None:
                raise ValueError("algorithm.entropy_top_q < 1: policy_loss needs entropy_BT")
            # A 0/1 weight, not a smaller mask: the aggregators keep counting all response tokens.
            selected_BT = top_entropy_mask_BT(entropy_BT, mask, self.cfg.entropy_top_q).to(mask.dtype)
            metrics["entropy_selected_frac"] = token_mean_metric(selected_BT, mask)
            weight_BT = selected_BT if weight_BT is None else weight_BT * selected_BT
        loss, pg_metrics = self.pg_loss(logp_BT, old_logp_BT, adv_BT, mask, self.agg, norm, weight_BT=weight_BT)
        metrics.update(pg_metrics)
        loss = loss + self._kl_term(logp_BT, ref_logp_BT, mask, norm, metrics)
        loss = loss + self._entropy_term(entropy_BT, mask, norm, metrics)
        metrics["loss"] = local_loss_metric(loss, self.agg, mask, norm)
        return loss, metrics

    def _kl_term(self, logp_BT, ref_logp_BT, mask, norm, metrics) -> torch.Tensor | float:
        kl_as_loss = self.cfg.kl_coef > 0 and not self.cfg.kl_in_reward
        if ref_logp_BT is None:
            if kl_as_loss:
                raise ValueError("algorithm.kl_coef > 0 (KL as a loss): policy_loss needs ref_logp_BT")
            return 0.0
        kl_BT = self.token_kl(logp_BT, ref_logp_BT.detach())
        metrics["kl"] = token_mean_metric(kl_BT, mask)
        if not kl_as_loss:
            return 0.0
        kl_loss = self.kl_coef * self.agg(kl_BT, mask, norm)
        metrics["kl_loss"] = local_loss_metric(kl_loss, self.agg, mask, norm)
        return kl_loss

    def _entropy_term(self, entropy_BT, mask, norm, metrics) -> torch.Tensor | float:
        if entropy_BT is None:
            if self.cfg.entropy_coef > 0:
                raise ValueError("algorithm.entropy_coef > 0: policy_loss needs entropy_BT")
            return 0.0
        metrics["entropy"] = token_mean_metric(entropy_BT, mask)
        if self.cfg.entropy_coef == 0:
            return 0.0
        return -self.cfg.entropy_coef * self.agg(entropy_BT, mask, norm)

    def value_loss(
        self,
        values_BT: torch.Tensor,
        old_values_BT: torch.Tensor,
        returns_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        norm: LossNormalizer,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """value_loss_coef * agg(0.5 max((V - R)^2, (V_clip - R)^2)), V_clip = V_old + clip(V - V_old, +-value_clip)
        (unclipped when value_clip = 0). Metrics (micro-batch means, as in policy_loss): value_loss
        (before the coefficient), value_clip_frac, values."""
        mask = mask_BT.to(values_BT.dtype)
        returns = returns_BT.detach()
        err = (values_BT - returns) ** 2
        metrics = {"values": token_mean_metric(values_BT, mask)}
        if self.cfg.value_clip > 0:
            old = old_values_BT.detach()
            v_clip = old + (values_BT - old).clamp(-self.cfg.value_clip, self.cfg.value_clip)
            err_clip = (v_clip - returns) ** 2
            metrics["value_clip_frac"] = token_mean_metric((err_clip > err).float(), mask)
            err = torch.maximum(err, err_clip)
        loss = self.agg(0.5 * err, mask, norm)
        metrics["value_loss"] = local_loss_metric(loss, self.agg, mask, norm)
        return self.cfg.value_loss_coef * loss, metrics

    # ---- state ---------------------------------------------------------------------------
    def update_after_step(self, metrics: Mapping[str, float]) -> None:
        """After the policy updates of an iteration: feed the adaptive KL controller the iteration's
        mean per-token KL (``metrics["kl"]``, as :meth:`policy_loss` names it). A skipped optimizer
        step (``metrics["skipped"]`` > 0) changed nothing and its statistics may be NaN: it is not fed.
        Call once per training iteration; a no-op for the fixed controller."""
        if self.cfg.kl_controller != "adaptive" or metrics.get("skipped", 0.0) > 0:
            return
        if "kl" not in metrics:
            raise KeyError("update_after_step: the adaptive KL controller needs metrics['kl'] (pass ref_logp_BT to policy_loss)")
        self.kl_ctl.update(float(metrics["kl"]))

    def state_dict(self) -> dict:
        return {
            "kl_coef": self.kl_ctl.value,
            "kl_coef_config": self.cfg.kl_coef,  # a resume with another algorithm.kl_coef starts from that
            "reward_moments": self.reward_moments.state_dict(),
            "adv_moments": self.adv_moments.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kl_coef_config", self.cfg.kl_coef) == self.cfg.kl_coef:  # else the new config's coefficient
            self.kl_ctl.value = float(state["kl_coef"])
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.adv_moments.load_state_dict(state["adv_moments"])
