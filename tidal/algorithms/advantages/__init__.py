"""Advantage estimators, one module each; importing this package registers them all."""

from tidal.algorithms.advantages import cpgd, gae, grpo, reinforce, reinforce_pp, rloo  # noqa: F401
