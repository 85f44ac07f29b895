from tidal.lazy import lazy_exports

_WHERE = {
    "Runtime": "tidal.distributed.runtime",
    "init_runtime": "tidal.distributed.runtime",
    "rollout_group_ranks": "tidal.distributed.runtime",
    "shutdown": "tidal.distributed.runtime",
    "gather_and_generate": "tidal.distributed.generate",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
