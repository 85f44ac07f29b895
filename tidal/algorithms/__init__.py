"""Advantage estimators, policy losses, KL, loss aggregation and shaping: small registered classes
behind one facade, :class:`Algorithm` (configured by :class:`AlgorithmConfig`, ``algorithm.*``)."""

from tidal.algorithms.algorithm import Algorithm
from tidal.algorithms.base import AdvantageEstimator, AdvantageInput, LossAggregator, LossNormalizer, PolicyLoss
from tidal.algorithms.config import (
    AlgorithmConfig,
    CPGDConfig,
    DynamicSamplingConfig,
    MismatchConfig,
    OverlongConfig,
)

__all__ = [
    "Algorithm",
    "AlgorithmConfig",
    "AdvantageEstimator",
    "AdvantageInput",
    "CPGDConfig",
    "DynamicSamplingConfig",
    "LossAggregator",
    "LossNormalizer",
    "MismatchConfig",
    "OverlongConfig",
    "PolicyLoss",
]
