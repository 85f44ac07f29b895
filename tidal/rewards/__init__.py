"""The reward layer: rule rewards, custom functions, local reward models and remote reward services,
combined per data-row label by recipes (see docs/rewards.md).

The names below are imported on first use, so that ``from tidal.rewards import RewardSample`` (what
a reward function's module does, also inside a reward worker process) does not import torch."""

from tidal.lazy import lazy_exports

_WHERE = {
    "RewardError": "tidal.rewards.base",
    "FunctionRewardConfig": "tidal.rewards.config",
    "ModelRewardConfig": "tidal.rewards.config",
    "RemoteRewardConfig": "tidal.rewards.config",
    "RewardConfig": "tidal.rewards.config",
    "RewardEngine": "tidal.rewards.engine",
    "LocalPlacement": "tidal.rewards.placement",
    "ModelPlacement": "tidal.rewards.placement",
    "RewardOutput": "tidal.rewards.types",
    "RewardSample": "tidal.rewards.types",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
