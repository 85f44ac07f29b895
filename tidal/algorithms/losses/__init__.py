"""Policy losses, one module each; importing this package registers them all."""

from tidal.algorithms.losses import cispo, cpgd, gmpo, gspo, ppo_clip  # noqa: F401
