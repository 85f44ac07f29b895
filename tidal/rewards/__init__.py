"""The reward layer: rule rewards, custom functions, local reward models and remote reward services,
combined per data-row label by recipes (see docs/rewards.md)."""

from tidal.rewards.base import RewardError
from tidal.rewards.config import FunctionRewardConfig, ModelRewardConfig, RemoteRewardConfig, RewardConfig
from tidal.rewards.engine import RewardEngine
from tidal.rewards.placement import LocalPlacement, ModelPlacement
from tidal.rewards.types import RewardOutput, RewardSample

__all__ = [
    "FunctionRewardConfig",
    "LocalPlacement",
    "ModelPlacement",
    "ModelRewardConfig",
    "RemoteRewardConfig",
    "RewardConfig",
    "RewardEngine",
    "RewardError",
    "RewardOutput",
    "RewardSample",
]
