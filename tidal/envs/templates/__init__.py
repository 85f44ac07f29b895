"""Chat templates of the model families whose tool-calling format :mod:`tidal.envs` follows, as
shipped in their ``tokenizer_config.json`` (Apache-2.0): ``qwen2_5`` (Qwen2.5-Instruct) and
``qwen3`` (Qwen3). Used by the calculator task's tokenizer and by the tests; a real checkpoint
brings its own template."""

from __future__ import annotations

from pathlib import Path

NAMES = ("qwen2_5", "qwen3")


def chat_template(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"unknown chat template {name!r}; shipped: {list(NAMES)}")
    return (Path(__file__).parent / f"{name}.jinja").read_text()
