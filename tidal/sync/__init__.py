"""Weight sync from the trained actor into the rollout engine (:mod:`tidal.sync.weights`)."""

from tidal.lazy import lazy_exports

_WHERE = {
    "SyncConfig": "tidal.sync.config",
    "WeightSyncError": "tidal.sync.weights",
    "mismatch_alarm": "tidal.sync.weights",
    "update_engine_weights": "tidal.sync.weights",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
