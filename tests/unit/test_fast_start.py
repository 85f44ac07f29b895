"""`tidal --help` and a config error answer without importing torch, numpy or transformers (seconds of
CPU each): each command runs in a fresh interpreter that reports which of them it imported."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tidal.lazy
from tidal.lazy import lazy_module

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "transformers", "deepspeed")
PROBE = """
import contextlib, io, json, sys
from tidal.cli import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "stderr": err.getvalue(), "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def run_cli(*argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["eval", "--help"]])
def test_help_imports_no_heavy_package(argv):
    res = run_cli(*argv)
    assert res["code"] == 0 and res["heavy"] == []


@pytest.mark.parametrize("argv, key", [
    (["train", "quickstart", "run.stepz=3"], "run.stepz"),  # unknown key, found while building
    (["train", "quickstart", "algorithm.lam=0.5"], "algorithm.lam"),  # a section's own check
    (["train", "quickstart", "train.micro_batch_tokens=3"], "train.micro_batch_tokens"),  # a cross-section check
    (["train", "calculator", "env.tool_timeout_s=100"], "env.step_timeout_s"),  # the environment section
    (["check", "quickstart", "algorithm.advantage=nope"], "algorithm.advantage"),
    (["eval", "quickstart", "--checkpoint", "ckpt", "rollout.partial.mode=carry"], "rollout.partial.mode"),
])
def test_config_error_imports_no_heavy_package(argv, key):
    res = run_cli(*argv)
    assert res["code"] == 2 and f"'{key}'" in res["stderr"], res
    assert res["heavy"] == []


@pytest.mark.parametrize("package", ["tidal.algorithms", "tidal.data", "tidal.distributed", "tidal.envs", "tidal.logging",
                                     "tidal.models", "tidal.rewards", "tidal.strategy", "tidal.sync", "tidal.tasks"])
def test_lazy_package_exports_resolve(package):
    """Every name a package exports lazily exists in the module it is said to come from."""
    mod = importlib.import_module(package)
    for name in mod.__all__:
        assert getattr(mod, name) is not None
    assert set(mod.__all__) <= set(dir(mod))
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        getattr(mod, "missing")


def test_lazy_module_imports_on_first_attribute():
    json_mod = lazy_module("json")
    assert "imported" not in repr(json_mod)
    assert json_mod.dumps([1]) == "[1]" and "imported" in repr(json_mod)
    assert tidal.lazy.lazy_module("no_such_module_xyz").__class__.__name__ == "LazyModule"
    with pytest.raises(ModuleNotFoundError):
        lazy_module("no_such_module_xyz").anything


def test_check_names_an_overlong_prompt_without_torch(tmp_path):
    """`tidal check` reads the data with the model folder's tokenizer before the model stack: an
    over-long prompt is named (file, row, the value that fits) and nothing heavy was imported (the
    import of torch and transformers alone took 36 s of 41 s on a busy 2-core machine; 3 s now)."""
    from transformers import Qwen2Config

    from tidal.tasks.tokenizer import save_tokenizer, train_tokenizer

    model = tmp_path / "model"
    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=1000, max_position_embeddings=2048).save_pretrained(model)
    save_tokenizer(train_tokenizer(["1+1? 2", "2+3? 5"]), str(model))
    rows = [{"prompt": "1+1?", "reference": "2"}] * 40 + [{"prompt": "1+1? " * 300, "reference": "2"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "my.yaml"
    config.write_text(f"run: {{output_dir: {tmp_path / 'run'}}}\nmodel: {{path: {model}}}\n"
                      f"data: {{train: [{{path: {tmp_path / 'train.jsonl'}}}], max_prompt_len: 256}}\n"
                      "rollout: {max_new_tokens: 64}\nreward: {components: {answer: {type: math_answer}}, recipes: {math: [[answer, 1.0]]}, default_recipe: math}\n")
    res = run_cli("check", str(config))
    assert res["code"] == 2 and res["heavy"] == [], res
    assert "'data.max_prompt_len'" in res["stderr"] and f"{tmp_path / 'train.jsonl'}:41, has " in res["stderr"], res
