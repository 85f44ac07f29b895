"""docs/partial_rollout.md works as written: its YAML merged into the quickstart config builds, its
`tidal train` commands parse into valid configs doing what they say, its bench command runs."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tidal.config import TidalConfig, load_config, resolve_config_path
from tidal.config_base import build

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "partial_rollout.md").read_text()


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def test_yaml_block_builds_on_the_quickstart():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC, re.DOTALL)
    assert blocks
    base = yaml.safe_load(resolve_config_path("quickstart").read_text())
    for block in blocks:
        cfg = build(TidalConfig, _merge(base, yaml.safe_load(block)))
        assert cfg.rollout.partial.mode == "carry" and cfg.rollout.partial.max_staleness == 4


def _commands(prefix: str) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC, re.DOTALL)
    return [shlex.split(line) for b in blocks for line in b.splitlines() if line.startswith(prefix)]


def test_train_commands_are_valid_configs():
    commands = _commands("tidal train")
    assert len(commands) == 2
    modes = [load_config(c[2], c[3:]).rollout.partial.mode for c in commands]
    assert modes == ["carry", "drop"]


def test_bench_command_lists_the_three_rollouts():
    (cmd,) = _commands("python -m bench.grpo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.5b-512x4096-natural", "0.5b-512x4096-natural-carry", "0.5b-512x4096-natural-drop"]
