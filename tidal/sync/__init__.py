"""Weight sync from the trained actor into the rollout engine (:mod:`tidal.sync.weights`)."""

from tidal.sync.config import SyncConfig
from tidal.sync.weights import WeightSyncError, mismatch_alarm, update_engine_weights

__all__ = ["SyncConfig", "WeightSyncError", "mismatch_alarm", "update_engine_weights"]
