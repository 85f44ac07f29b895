"""Loss aggregation modes: how per-token losses of a micro-batch become its share of the global loss.

Every mode divides by a count of the WHOLE global batch (``LossNormalizer``), never of the
micro-batch, so the shares of all micro-batches and ranks sum to the global aggregate:

- token_mean:           sum_{b,t} m l / N_tokens                               (DAPO token-level)
- seq_mean_token_mean:  sum_b [sum_t m l / sum_t m] / N_seqs                   (GRPO paper, GSPO)
- seq_mean_token_sum:   sum_b sum_t m l / N_seqs
- constant:             sum_b sum_t m l / (N_seqs * C)                         (Dr.GRPO, C = budget)

Rows without response tokens contribute 0 in every mode.
"""

from __future__ import annotations

from tidal.algorithms.base import LossAggregator, LossNormalizer
from tidal.algorithms.registry import LOSS_AGGREGATORS
from tidal.lazy import lazy_module

torch = lazy_module("torch")


def _masked_sum_B(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (loss_BT * mask_BT).sum(-1)


@LOSS_AGGREGATORS.register("token_mean")
class TokenMean(LossAggregator):
    def __init__(self, cfg=None):
        pass

    def __call__(self, loss_BT, mask_BT, norm: LossNormalizer):
        return _masked_sum_B(loss_BT, mask_BT).sum() / max(norm.num_tokens, 1.0)


@LOSS_AGGREGATORS.register("seq_mean_token_mean")
class SeqMeanTokenMean(LossAggregator):
    counts = "seqs"

    def __init__(self, cfg=None):
        pass

    def __call__(self, loss_BT, mask_BT, norm: LossNormalizer):
        len_B = mask_BT.sum(-1)
        seq_B = _masked_sum_B(loss_BT, mask_BT) / len_B.clamp(min=1)
        return seq_B.sum() / max(norm.num_seqs, 1.0)


@LOSS_AGGREGATORS.register("seq_mean_token_sum")
class SeqMeanTokenSum(LossAggregator):
    counts = "seqs"

    def __init__(self, cfg=None):
        pass

    def __call__(self, loss_BT, mask_BT, norm: LossNormalizer):
        return _masked_sum_B(loss_BT, mask_BT).sum() / max(norm.num_seqs, 1.0)


@LOSS_AGGREGATORS.register("constant")
class ConstantNormalizer(LossAggregator):
    """Dr.GRPO: divide the token sum by a constant (the generation budget) instead of the length."""

    counts = "seqs"

    def __init__(self, cfg):
        self.constant = float(cfg.loss_agg_constant)

    def __call__(self, loss_BT, mask_BT, norm: LossNormalizer):
        return _masked_sum_B(loss_BT, mask_BT).sum() / (max(norm.num_seqs, 1.0) * self.constant)


def token_mean_metric(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Detached mean of a per-token metric over the micro-batch's response tokens."""
    return ((x_BT.detach() * mask_BT).sum() / mask_BT.sum().clamp(min=1)).float()


def local_loss_metric(share: torch.Tensor, agg: LossAggregator, mask_BT: torch.Tensor, norm: LossNormalizer) -> torch.Tensor:
    """A loss share as a metric: the micro-batch's own aggregate (detached)."""
    return (share.detach() * agg.local_scale(mask_BT, norm)).float()
