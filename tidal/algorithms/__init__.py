"""Advantage estimators, policy losses, KL, loss aggregation and shaping: small registered classes
behind one facade, :class:`Algorithm` (configured by :class:`AlgorithmConfig`, ``algorithm.*``)."""

from tidal.lazy import lazy_exports

_WHERE = {
    "Algorithm": "tidal.algorithms.algorithm",
    "AlgorithmConfig": "tidal.algorithms.config",
    "AdvantageEstimator": "tidal.algorithms.base",
    "AdvantageInput": "tidal.algorithms.base",
    "CPGDConfig": "tidal.algorithms.config",
    "DynamicSamplingConfig": "tidal.algorithms.config",
    "LossAggregator": "tidal.algorithms.base",
    "LossNormalizer": "tidal.algorithms.base",
    "MismatchConfig": "tidal.algorithms.config",
    "OverlongConfig": "tidal.algorithms.config",
    "PolicyLoss": "tidal.algorithms.base",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
