"""Optional packages (tensorboard, wandb, deepspeed, peft, vllm, sglang): one table, equal to the
pyproject extras; a missing one is a one-line config error with the install command, exit 2, before
any model loads."""

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tidal import optional_deps
from tidal.cli import main
from tidal.config import load_config
from tidal.config_base import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_table_equals_the_pyproject_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, dep in optional_deps.OPTIONAL.items():
        (req,) = [Requirement(r) for r in extras[name]]
        assert req.name == dep.dists[0] and str(req.specifier) == str(Requirement(f"x{dep.spec}").specifier), name
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not {Requirement(r).name for r in core} & {d.dists[0] for d in optional_deps.OPTIONAL.values()}


def test_what_a_config_needs():
    cfg = load_config("quickstart", ["logging.backends=[console,tensorboard,wandb]", "strategy.backend=deepspeed",
                                     "model.lora.rank=4", "engine.backend=vllm"])
    assert [(e, k) for e, k, _ in optional_deps.dependencies_of(cfg)] == [
        ("tensorboard", "logging.backends"), ("wandb", "logging.backends"), ("deepspeed", "strategy.backend"),
        ("lora", "model.lora.rank"), ("vllm", "engine.backend")]
    assert optional_deps.dependencies_of(load_config("quickstart")) == []


def _hide(monkeypatch, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(optional_deps.importlib.util, "find_spec", lambda name: None if name == module else real(name))


@pytest.mark.parametrize("override, module, extra", [
    ("logging.backends=[console,tensorboard]", "tensorboard", "tensorboard"),
    ("logging.backends=[wandb]", "wandb", "wandb"),
    ("strategy.backend=deepspeed", "deepspeed", "deepspeed"),
    ("model.lora.rank=8", "peft", "lora"),
    ("engine.backend=sglang", "sglang", "sglang"),
    ("data.train=[{reasoning_gym: {datasets: {basic_arithmetic: {}}}}]", "reasoning_gym", "reasoning-gym"),
    ("env.name=mcp", "mcp", "mcp"),
    ("env.name=openenv", "openenv", "openenv"),
])
def test_missing_package_is_one_line_exit_2_before_anything_loads(monkeypatch, capsys, tmp_path, override, module, extra):
    _hide(monkeypatch, module)
    monkeypatch.setattr("tidal.build.build_trainer", lambda cfg: pytest.fail("a model would load"))
    rc = main(["train", "quickstart", override, f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"pip install -e '.[{extra}]' (in the Tidal checkout)" in err and f"{module} is not installed" in err


def test_version_outside_the_supported_range(monkeypatch):
    monkeypatch.setattr(optional_deps.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(optional_deps.importlib.metadata, "version", lambda dist: "0.18.0")
    with pytest.raises(ConfigError, match=r"strategy.backend.*installed deepspeed 0.18.0 is outside the supported range >=0.19.8,<0.20"):
        optional_deps.require("deepspeed", "strategy.backend", "strategy.backend=deepspeed")


def test_installed_packages_pass():
    for extra, dep in optional_deps.OPTIONAL.items():
        if importlib.util.find_spec(dep.module) is not None and dep.module in ("tensorboard", "deepspeed", "peft"):
            assert optional_deps.problem(extra) is None, (extra, sys.version)
