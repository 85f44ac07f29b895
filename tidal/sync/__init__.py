"""Weight sync from the trained actor into the rollout engine (:mod:`tidal.sync.weights`)."""

from tidal.sync.weights import update_engine_weights

__all__ = ["update_engine_weights"]
