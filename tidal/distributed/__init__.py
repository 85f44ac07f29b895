from tidal.distributed.generate import gather_and_generate
from tidal.distributed.runtime import Runtime, init_runtime, rollout_group_ranks, shutdown

__all__ = ["Runtime", "init_runtime", "rollout_group_ranks", "shutdown", "gather_and_generate"]
