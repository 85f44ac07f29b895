"""Every shipped example config loads, validates, and fits the world sizes it is meant for."""

from pathlib import Path

import pytest

from tidal.config import load_config

ROOT = Path(__file__).resolve().parents[2]
# examples/kubernetes/ holds a Kubernetes manifest, not a Tidal config (test_docs_blocks checks its commands)
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "kubernetes" not in p.parts)


def test_there_are_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_example_config_loads(path):
    cfg = load_config(str(path))
    cfg.check_world(1)
    if "gsm8k" in str(path):
        cfg.check_world(8)
