"""Contracts of the algorithm pieces. Shapes: B sequences, T token positions of ``Experience.sequences``.

Every per-token tensor is aligned with the sequence: ``x_BT[b, t]`` belongs to token ``sequences[b, t]``
(its logprob is log p(sequences[b,t] | sequences[b,:t])). ``action_mask_BT`` is 1 on the tokens the
policy sampled, and only there. It need not be contiguous: a multi-turn row (see :mod:`tidal.envs`)
is prompt, turn 1, observation 1 (tool output: not sampled, mask 0), turn 2, ..., padding. Every
piece here reads the mask, never a span: sequence lengths are counts of sampled tokens, and the
recursions (returns-to-go, GAE) run over sampled tokens only, so a gapped row gives the same values
on its sampled tokens as the same tokens laid out contiguously.
"""

from __future__ import annotations

import abc
import dataclasses

from tidal.lazy import lazy_module

torch = lazy_module("torch")


@dataclasses.dataclass(kw_only=True)
class AdvantageInput:
    """What an estimator sees for one rollout batch (all on one device).

    rewards_B: scalar (outcome) reward per sequence (after shaping, before KL-in-reward), placed
        at its last sampled token by the discounting estimators.
    token_rewards_BT: extra per-token reward, or None: -kl_coef * kl when KL is in the reward,
        and/or the per-turn rewards of a multi-turn trajectory (each at the last sampled token of
        its turn, :func:`tidal.envs.packing.pack_trajectories`). Only its values on sampled tokens
        count.
    action_mask_BT: 1 on sampled tokens (may have gaps, see the module docstring).
    values_BT: critic values at sampled tokens (estimators with needs_critic), else None.
    group_ids_B: prompt index of each sequence; the n samples of one prompt share an id.
    trajectory_ids_B: None (every row is its own trajectory) or the trajectory of each row, for
        trajectories split over several rows (a chat template that rewrites earlier turns starts
        a new row per turn, see docs/agentic.md). Rows of one trajectory must appear in turn order
        and share group id and rewards_B; :meth:`Algorithm.compute_advantages` then computes the
        advantages as if the rows were one row laid end to end (one sample per trajectory in the
        group statistics, returns and GAE carried from a row into the previous one).
    """

    rewards_B: torch.Tensor
    action_mask_BT: torch.Tensor
    group_ids_B: torch.Tensor
    token_rewards_BT: torch.Tensor | None = None
    values_BT: torch.Tensor | None = None
    trajectory_ids_B: torch.Tensor | None = None


class AdvantageEstimator(abc.ABC):
    """Computes per-token advantages and returns (returns are the critic's targets, or equal to
    advantages for critic-free estimators). Both are zero outside the action mask.

    Traits (class attributes, read by config validation and the trainer):
    needs_critic: it reads ``values_BT`` (the run trains a critic).
    discounts: it discounts with ``gamma`` (group baselines do not: gamma must stay 1 for them).
    whitens_batch: it whitens its advantages over the batch itself (``adv_norm: batch`` would repeat it).
    group_baseline: its baseline is the mean of the prompt's group of samples, so a group of one
    sample gets no outcome advantage (``rollout.n_samples: 1`` cannot learn from rewards).
    """

    needs_critic: bool = False
    discounts: bool = False
    whitens_batch: bool = False
    group_baseline: bool = False

    @abc.abstractmethod
    def compute(self, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (advantages_BT, returns_BT)."""


@dataclasses.dataclass(kw_only=True)
class LossNormalizer:
    """Global counts of one optimizer step (summed over micro-batches and all DP ranks), so that
    summing per-micro-batch losses gives the aggregate of the whole global batch.

    num_tokens: response tokens in the global batch; num_seqs: sequences in the global batch
    (those with at least one response token: a fully masked row contributes nothing).
    """

    num_tokens: float
    num_seqs: float

    @classmethod
    def from_mask(cls, mask_BT: torch.Tensor, group=None) -> "LossNormalizer":
        """Counts of the response mask of ALL micro-batches of one optimizer step on this rank
        (pass them concatenated, or add the normalisers of the parts with ``+``), summed over the
        ranks of ``group`` when given (a group that reduces CPU tensors, e.g. gloo)."""
        counts = torch.stack([mask_BT.sum(), (mask_BT.sum(-1) > 0).sum()]).to(torch.float64).cpu()
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        return cls(num_tokens=float(counts[0]), num_seqs=float(counts[1]))

    def __add__(self, other: "LossNormalizer") -> "LossNormalizer":
        return LossNormalizer(num_tokens=self.num_tokens + other.num_tokens, num_seqs=self.num_seqs + other.num_seqs)


class LossAggregator(abc.ABC):
    # Which global count the shares divide by: "tokens" (num_tokens) or "seqs" (num_seqs).
    counts: str = "tokens"

    @abc.abstractmethod
    def __call__(self, loss_BT: torch.Tensor, mask_BT: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
        """Reduce per-token losses of one micro-batch to its share of the global-batch loss."""

    def local_scale(self, mask_BT: torch.Tensor, norm: LossNormalizer) -> float:
        """Factor turning a share into the micro-batch's own aggregate (as if it were the whole
        batch): global count / micro-batch count. Used for loss METRICS only."""
        local = LossNormalizer.from_mask(mask_BT)
        if self.counts == "tokens":
            return max(norm.num_tokens, 1.0) / max(local.num_tokens, 1.0)
        return max(norm.num_seqs, 1.0) / max(local.num_seqs, 1.0)


class PolicyLoss(abc.ABC):
    """Traits (class attributes, read by config validation):
    ratio_clip: clips the ratio to [1 - clip_low, 1 + clip_high] (so clip_low < 1).
    weight_clip: clips an importance weight with that range, where clip_low = 1 means no lower bound.
    sequence_ratio: its ratio is per sequence (a per-token weight cannot select tokens).
    dual_clip: supports the dual-clip bound ``algorithm.dual_clip``.
    """

    ratio_clip: bool = False
    weight_clip: bool = False
    sequence_ratio: bool = False
    dual_clip: bool = False

    @abc.abstractmethod
    def __call__(
        self,
        logp_BT: torch.Tensor,
        old_logp_BT: torch.Tensor,
        adv_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        agg: LossAggregator,
        norm: LossNormalizer,
        *,
        weight_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return (scalar loss share, detached metrics such as clip_frac).

        weight_BT: detached per-token weight of the policy-gradient term (truncated importance
        sampling of the rollout/trainer mismatch, token selection), or None for 1. Metrics are
        means over this micro-batch (token metrics over its response tokens; pg_loss is the
        micro-batch's own aggregate), so their response-token-weighted mean over micro-batches
        and ranks is the global value.
        """
