"""Registries of the algorithm variants, selected by name from ``algorithm.*``.

Each implementation module registers itself on import; :mod:`tidal.algorithms.config` imports them
all (this module imports none: the arrows point one way) so that names can be validated when the
config is built.
"""

from __future__ import annotations

from tidal.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGGREGATORS: Registry = Registry("loss aggregation")
KL_ESTIMATORS: Registry = Registry("KL estimator")
