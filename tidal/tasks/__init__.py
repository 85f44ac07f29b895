"""Built-in tasks whose assets Tidal builds locally, with no download (``task.*`` config).

``prepare(TaskConfig(name="arithmetic"))`` returns the paths of a train/eval JSONL pair, and of a
directory with a trained tokenizer and a warm-started tiny Qwen2 model; the reward is
``tidal.tasks.quickstart:arithmetic_reward``. :mod:`tidal.tasks.calculator` builds the tool-use
task (``prepare_calculator``), whose wiring into ``task.*`` comes with the trainer's environments.
"""

from tidal.tasks.config import TaskConfig
from tidal.tasks.assets import TaskAssets, prepare

__all__ = ["TaskAssets", "TaskConfig", "prepare"]
