"""Built-in tasks whose assets Tidal builds locally, with no download (``task.*`` config).

``prepare(TaskConfig(name="arithmetic"))`` returns the paths of a train/eval JSONL pair, and of a
directory with a trained tokenizer and a warm-started tiny Qwen2 model; the reward is
``tidal.tasks.quickstart:arithmetic_reward``. ``prepare(TaskConfig(name="calculator"))`` builds the
tool-use task (:mod:`tidal.tasks.calculator`: a tiny model that must learn to call a calculator
tool; reward ``tidal.tasks.calculator:calculator_reward``, environment ``env.name: calculator``,
run config ``tidal/configs/calculator.yaml``).
"""

from tidal.lazy import lazy_exports

_WHERE = {
    "TaskAssets": "tidal.tasks.store",
    "TaskConfig": "tidal.tasks.config",
    "prepare": "tidal.tasks.assets",
}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
