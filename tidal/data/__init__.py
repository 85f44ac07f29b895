"""Prompt datasets, chat templating and the stateful distributed sampler."""

from tidal.data.config import DataConfig, DataSource
from tidal.data.dataset import PromptDataset, PromptItem
from tidal.data.sampler import StatefulDistributedSampler

__all__ = ["DataConfig", "DataSource", "PromptDataset", "PromptItem", "StatefulDistributedSampler"]
