"""Every fenced block of README.md and docs/*.md works as written (issue 23 item 1).

- ``yaml``: loaded and validated as a Tidal config. A block with ``run`` and ``model`` is a whole
  config; any other block replaces those sections of the README's whole config (the GSM8K one).
- ``json``: parses (one document, or one per line).
- ``python``: compiles, and every ``from X import a, b`` in it names something that exists.
- ``bash``: every command is parsed. ``tidal`` commands (also ``python -m tidal.cli`` and under
  ``torchrun``) go through the CLI's own parser, and train/eval/export load and validate their config
  with the overrides as written; ``pip install`` of Tidal is from a checkout (it is on no index) with extras pyproject.toml
  declares (also in the prose's inline code); scripts, test files and
  modules named exist; an ``sbatch`` script's and a ``kubectl apply -f`` manifest's (Kubeflow
  ``PyTorchJob``) ``tidal`` commands are checked as above, and a manifest's ``--nnodes`` (its maximum) is its pods.
  A program this test does not know fails it, so a new kind of command gets a check here.
- no language: text (diagrams, file listings); a block whose first word is a known program must be
  marked ``bash``.

The commands that run on CPU are run by the end-to-end tests: ``tidal train quickstart``
(tests/e2e/test_quickstart.py), ``tidal train calculator`` (tests/e2e/test_calculator_e2e.py),
``tidal train rm_quickstart`` / ``tidal eval`` / ``tidal export`` (tests/integration/test_cli_eval_export.py,
the reward-model e2e tests), ``tidal report`` (tests/unit/test_report.py).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from tidal.cli import parse_args
from tidal.config import TidalConfig, load_config
from tidal.config_base import build, load_yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Placeholder config names in the docs ("your config") and the shipped config that stands for them.
PLACEHOLDERS = {"my.yaml": "quickstart", "my_vl.yaml": "examples/squares/config.yaml"}
KNOWN_PROGRAMS = ("tidal", "torchrun", "python", "python3", "pip", "pytest", "sbatch", "kubectl")


def blocks() -> list[tuple[str, str, str]]:
    """(where, language, text) of every fenced block."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1), m.group(2)))
    return out


def of(lang: str) -> list[tuple[str, str]]:
    return [(where, text) for where, l, text in blocks() if l == lang]


def named_yaml_files(tmp_path: Path) -> dict[str, str]:
    """The YAML blocks whose first line names their file (``# my_grpo.yaml``), written to ``tmp_path``."""
    files = {}
    for _, text in of("yaml"):
        first = text.splitlines()[0]
        m = re.fullmatch(r"#\s*(\S+\.ya?ml)\s*", first)
        if m:
            path = tmp_path / m.group(1)
            path.write_text(text)
            files[m.group(1)] = str(path)
    return files


def test_every_block_has_a_known_kind():
    assert {lang for _, lang, _ in blocks()} <= {"", "yaml", "json", "python", "bash"}
    for where, text in of(""):
        first = text.split(maxsplit=1)[0] if text.split() else ""
        assert first not in KNOWN_PROGRAMS, f"{where}: a command in an unmarked block (mark it ```bash)"


@pytest.mark.parametrize("where,text", of("yaml"), ids=[w for w, _ in of("yaml")])
def test_yaml_blocks_are_valid_configs(where, text):
    data = load_yaml(text, where)  # as Tidal reads a config: a key written twice is an error
    assert isinstance(data, dict), where
    if {"run", "model"} <= data.keys():
        build(TidalConfig, data)
        return
    whole = [d for d in (load_yaml(t, w) for w, t in of("yaml") if w.startswith("README")) if {"run", "model"} <= d.keys()]
    build(TidalConfig, {**whole[0], **data})


@pytest.mark.parametrize("where,text", of("json"), ids=[w for w, _ in of("json")])
def test_json_blocks_parse(where, text):
    try:
        json.loads(text)
    except json.JSONDecodeError:
        for line in text.splitlines():
            json.loads(line)


@pytest.mark.parametrize("where,text", of("python"), ids=[w for w, _ in of("python")])
def test_python_blocks_compile_and_import_what_exists(where, text):
    tree = ast.parse(text, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("tidal"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, split at ``&&``,
    leading ``VAR=value`` / ``VAR=$(...)`` assignments removed."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            part = re.sub(r"^\s*(\w+=(\$\([^)]*\)|\S*)\s+)+", "", part)
            words = shlex.split(part, comments=True)
            if words:
                out.append(words)
    return out


def tidal_argv(words: list[str]) -> list[str] | None:
    """The `tidal` arguments of a command that runs the tidal CLI, else None."""
    if words[0] == "tidal":
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1] == "tidal.cli":
        return words[words.index("-m") + 2 :]
    return None


def check_tidal(argv: list[str], where: str, files: dict[str, str]) -> None:
    if argv[0] in ("serve-reward", "serve-teacher"):
        module = "tidal.rewards.server" if argv[0] == "serve-reward" else "tidal.distill.server"
        importlib.import_module(module).parse_args(argv[1:])
        return
    if argv[0] == "launch":  # torchrun's options by torchrun's parser, then the Tidal command
        from tidal.launch import parse_launch_args

        check_tidal(parse_launch_args(argv[1:])[1], where, files)
        return
    if argv[0] == "report":
        assert len(argv) == 2, f"{where}: tidal report RUN_DIR"
        return
    args = parse_args(argv)
    config = files.get(args.config) or PLACEHOLDERS.get(args.config, args.config)
    load_config(config, args.overrides)


def check_sbatch(script: Path, where: str) -> None:
    """The ``tidal`` commands of a Slurm batch script (after ``srun`` and its options)."""
    assert script.is_file(), f"{where}: {script} does not exist"
    found = [words[words.index("tidal") + 1 :] for words in commands(script.read_text()) if "tidal" in words]
    assert found, f"{where}: {script} runs no tidal command"
    for argv in found:
        check_tidal(argv, f"{where} ({script.name})", {})


def check_pytorchjob(manifest: Path, where: str) -> None:
    """A Kubeflow PyTorchJob: every pod runs ``tidal launch`` with ``--nnodes`` = the number of pods."""
    assert manifest.is_file(), f"{where}: {manifest} does not exist"
    for doc in yaml.safe_load_all(manifest.read_text()):
        assert doc["kind"] == "PyTorchJob", f"{where}: {manifest} is a {doc['kind']}"
        replicas = doc["spec"]["pytorchReplicaSpecs"].values()
        pods = sum(r["replicas"] for r in replicas)
        for replica in replicas:
            for container in replica["template"]["spec"]["containers"]:
                argv = tidal_argv(container["command"])
                assert argv is not None and argv[0] == "launch", f"{where}: {manifest} runs {container['command'][:3]}"
                check_tidal(argv, f"{where} ({manifest.name})", {})
                from tidal.launch import parse_launch_args

                nnodes = parse_launch_args(argv[1:])[0].nnodes  # N, or MIN:MAX with MAX the pods
                assert nnodes.rpartition(":")[2] == str(pods), f"{where}: {manifest}'s --nnodes {nnodes} is not its {pods} pods"


def check_pip_install(words: list[str], where: str) -> None:
    """A ``pip install`` of Tidal runs as written: from a checkout (``.`` or ``.[extras]``; tidal-rft
    is on no package index), with extras that pyproject.toml declares."""
    args = words[words.index("install") + 1 :] if "install" in words else []
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for arg in args:
        assert not re.match(r"tidal[-_]rft\b", arg), (f"{where}: pip install {arg}: tidal-rft is on no package index; "
                                                       "install from a checkout: pip install -e '.[extras]'")
        m = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if m:
            missing = set(m.group(1).split(",")) - extras.keys()
            assert not missing, f"{where}: pip install {arg}: pyproject.toml has no extra {sorted(missing)}"


def inline_pip_installs() -> list[tuple[str, list[str]]]:
    """(where, words) of every ``pip install`` in an inline code span of the docs' prose."""
    out = []
    for doc in DOCS:
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), doc.read_text())
        for m in re.finditer(r"`([^`\n]*\bpip3? install [^`\n]*)`", text):
            line = text[: m.start()].count("\n") + 1
            for words in commands(m.group(1)):
                if Path(words[0]).name in ("pip", "pip3") or words[1:3] == ["-m", "pip"]:
                    out.append((f"{doc.relative_to(ROOT)}:{line}", words))
    return out


def test_inline_pip_installs_run_as_written():
    found = inline_pip_installs()
    assert len(found) > 5
    for where, words in found:
        check_pip_install(words, where)


def test_pip_install_check_fails_on_an_index_install_and_a_missing_extra():
    with pytest.raises(AssertionError, match="no package index"):
        check_pip_install(["pip", "install", "tidal-rft[mcp]"], "x")
    with pytest.raises(AssertionError, match=r"no extra \['nope'\]"):
        check_pip_install(["pip", "install", "-e", ".[reasoning-gym,nope]"], "x")
    check_pip_install(["pip", "install", "-e", ".[reasoning-gym,mcp,openenv]"], "x")


def check_other(words: list[str], where: str) -> None:
    program = Path(words[0]).name
    if program == "sbatch":
        return check_sbatch(ROOT / words[-1], where)
    if program == "kubectl":
        return check_pytorchjob(ROOT / words[words.index("-f") + 1], where)
    if program in ("pip", "pip3") or words[1:3] == ["-m", "pip"]:
        return check_pip_install(words, where)
    if program in ("export",) or words[1:3] == ["-m", "venv"]:
        return
    if program == "pytest" or words[1:3] == ["-m", "pytest"]:
        for arg in words[1:]:
            if arg.endswith(".py"):
                assert (ROOT / arg).exists(), f"{where}: {arg} does not exist"
        return
    if program in ("python", "python3", "torchrun"):
        script = next((w for w in words[1:] if w.endswith(".py")), None)
        if "-m" in words:
            module = words[words.index("-m") + 1]
            assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
        elif script is not None:
            assert (ROOT / script).exists(), f"{where}: {script} does not exist"
        else:
            raise AssertionError(f"{where}: what does {' '.join(words)} run?")
        return
    raise AssertionError(f"{where}: a command this test does not check: {' '.join(words)}")


def test_shell_commands_parse_and_their_configs_load(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository
    files = named_yaml_files(tmp_path)
    checked = 0
    for where, text in of("bash"):
        for words in commands(text):
            argv = tidal_argv(words)
            try:
                if argv is not None:
                    check_tidal(argv, where, files)
                else:
                    check_other(words, where)
            except SystemExit as e:  # argparse
                raise AssertionError(f"{where}: {' '.join(words)} does not parse (exit {e.code})") from None
            checked += 1
    assert checked > 30


def test_every_doc_named_exists():
    """Every ``docs/<name>.md`` named in the docs, the shipped configs and the code, and every
    relative Markdown link of the docs, is a file (issue 47 item 8: a shipped config named a page
    that did not exist)."""
    texts = {p: p.read_text() for p in [*DOCS, *(ROOT / "tidal").rglob("*.py"), *(ROOT / "tidal" / "configs").glob("*.yaml")]}
    named = 0
    for path, text in texts.items():
        for m in re.finditer(r"\bdocs/([\w-]+\.md)", text):
            assert (ROOT / "docs" / m.group(1)).is_file(), f"{path.relative_to(ROOT)} names docs/{m.group(1)}, which does not exist"
            named += 1
        if path.suffix == ".md":
            for m in re.finditer(r"\]\(((?!https?:)[\w./-]+\.md)(#[\w-]*)?\)", text):
                assert (path.parent / m.group(1)).is_file(), f"{path.relative_to(ROOT)} links {m.group(1)}, which does not exist"
                named += 1
    assert named > 50
