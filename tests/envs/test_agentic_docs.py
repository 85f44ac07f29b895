"""The Python examples of docs/agentic.md run as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "agentic.md"


def test_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert blocks
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {"__name__": "agentic_doc"})


def test_yaml_blocks_are_valid_config_sections():
    import yaml

    from tidal.config_base import build
    from tidal.envs import EnvConfig

    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert blocks
    for block in blocks:
        build(EnvConfig, yaml.safe_load(block)["env"])
