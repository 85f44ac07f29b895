"""The structure rules of docs/architecture.md, checked on the source (AST), so they keep holding:
one owner moves models and engine state between devices, constructors under trainer/ take few
parameters, imports point down (no cycle in engine/ or trainer/), and no dead code (vulture)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIDAL = ROOT / "tidal"
PLACEMENT = {"wake_up", "sleep", "offload_model", "reload_model"}
LAYER = {  # a package may import only from packages of a lower or equal floor (docs/architecture.md)
    "cli": 9, "build": 8, "check": 8, "inputs": 8, "launch": 8, "config": 7, "jobs": 7, "rm": 7, "memory": 7, "trainer": 6, "run": 5, "strategy": 5, "sync": 5, "envs": 5, "tasks": 5,
    "distributed": 4, "engine": 4, "rewards": 3, "distill": 3, "algorithms": 3, "models": 3, "data": 3, "logging": 3,
    "report": 3,
    "families": 2, "registry": 1, "dtypes": 1, "host_memory": 1, "optional_deps": 1, "config_base": 0, "files": 0, "lazy": 0,
    "numerics": 2, "exact": 1, "sampling_filter": 1,
}


def modules():
    for path in sorted(TIDAL.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _package(path: Path) -> str:
    rel = path.relative_to(TIDAL).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def test_one_owner_moves_models_and_engine_state():
    """Outside engine/ and strategy/, only the phase owner names the placement mechanisms."""
    users = set()
    for path, tree in modules():
        if _package(path) in ("engine", "strategy"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in PLACEMENT:
                if isinstance(node.value, ast.Name) and node.value.id in ("time", "asyncio"):
                    continue  # time.sleep, asyncio.sleep
                users.add(str(path.relative_to(ROOT)))
    assert users == {"tidal/trainer/colocation.py"}, users


def test_trainer_constructors_take_at_most_eight_parameters():
    for path, tree in modules():
        if _package(path) != "trainer":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1  # not self
                assert n <= 8, f"{path.name}:{node.lineno} __init__ takes {n} parameters"


def _is_module(dotted: str) -> bool:
    return ROOT.joinpath(*dotted.split(".")).with_suffix(".py").is_file()


def _imports(tree) -> set[str]:
    """The tidal modules a module imports (``from pkg import submodule`` counts as the submodule)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tidal"):
            subs = {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
            out.update(subs or {node.module})
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tidal"))
    return out


def test_imports_point_down():
    for path, tree in modules():
        mine = _package(path)
        for mod in _imports(tree):
            parts = mod.split(".")
            if len(parts) < 2:
                continue
            theirs = parts[1]
            assert LAYER[theirs] <= LAYER[mine], f"{path.relative_to(ROOT)} imports {mod} (floor {LAYER[theirs]} > {LAYER[mine]})"


@pytest.mark.parametrize("package", ["engine", "trainer"])
def test_no_import_cycle_inside(package):
    graph = {}
    for path, tree in modules():
        if _package(path) != package:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m in _imports(tree) if m.startswith(f"tidal.{package}")}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [nxt])}"
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_no_dead_code():
    """vulture over the library, the benchmarks and the examples, with the reviewed whitelist."""
    if shutil.which("vulture") is None and subprocess.run([sys.executable, "-m", "vulture", "--version"],
                                                          capture_output=True).returncode != 0:
        pytest.fail("vulture is not installed: pip install -e '.[test]'")
    out = subprocess.run(
        [sys.executable, "-m", "vulture", "tidal", "bench", "examples", "tools/vulture_whitelist.py", "--min-confidence", "60"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr
