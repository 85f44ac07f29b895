"""Prompt datasets, chat templating and the stateful distributed sampler."""

from tidal.lazy import lazy_exports

_WHERE = {
    "DataConfig": "tidal.data.config",
    "DataSource": "tidal.data.config",
    "PromptDataset": "tidal.data.dataset",
    "PromptItem": "tidal.data.dataset",
    "StatefulDistributedSampler": "tidal.data.sampler",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
