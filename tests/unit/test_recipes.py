"""The launch recipes train as written (issue 48 item 4): examples/slurm/train.sbatch and
examples/kubernetes/pytorchjob.yaml. Their commands are also checked by tests/unit/test_docs_blocks.py
(the CLI's parser, the config with its overrides); here:

- the config each recipe names loads and passes the optional-package check with only what the
  recipe's own install line installs (the other extras made absent), on the recipe's world (2
  nodes x 8 ranks: the batch divides, the rollout TP groups stay in a node);
- the Slurm script: ``bash -n`` and ``shellcheck`` (where installed), ``srun`` gets the CPUs
  (``SRUN_CPUS_PER_TASK``), the time-limit signal comes before the agents' shutdown timeout ends,
  no network interface forced;
- the manifest: a PyTorchJob with the fields the operator needs, gang scheduling of all its pods,
  an elastic node range whose maximum is its pods, a grace period past the shutdown timeout.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tidal import optional_deps
from tidal.config import load_config
from tidal.launch import parse_launch_args

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
MANIFEST = ROOT / "examples" / "kubernetes" / "pytorchjob.yaml"


def _install_extras(text: str) -> set[str]:
    """The extras of the recipe's documented install line (``pip install '.[a,b]'``)."""
    lines = re.findall(r"pip install '\.\[([\w,-]+)\]'", text)
    assert len(lines) == 1, "a recipe says once how to install Tidal for it"
    return set(lines[0].split(","))


def _sbatch_launch() -> list[str]:
    joined = SBATCH.read_text().replace("\\\n", " ")
    line = next(l for l in joined.splitlines() if l.strip().startswith("srun "))
    words = line.split()
    return words[words.index("launch") + 1:]


def _pods() -> tuple[dict, list[dict]]:
    job = yaml.safe_load(MANIFEST.read_text())
    return job, list(job["spec"]["pytorchReplicaSpecs"].values())


def _manifest_launch() -> list[str]:
    _, replicas = _pods()
    command = replicas[0]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["tidal", "launch"]
    return command[2:]


@pytest.mark.parametrize("recipe", ["slurm", "kubernetes"])
def test_the_config_a_recipe_names_loads_with_the_recipes_install(recipe, monkeypatch):
    path, argv = (SBATCH, _sbatch_launch()) if recipe == "slurm" else (MANIFEST, _manifest_launch())
    args, tidal_argv = parse_launch_args([a.replace('"', "") for a in argv] if recipe == "slurm" else argv)
    extras = _install_extras(path.read_text())
    assert extras <= optional_deps.OPTIONAL.keys()
    installed = optional_deps.installed_version
    monkeypatch.setattr(optional_deps, "installed_version",
                        lambda dep: installed(dep) if dep.extra in extras else None)  # only the recipe's install
    assert tidal_argv[0] == "train"
    overrides = [o for o in tidal_argv[2:] if "=" in o]
    cfg = load_config(str(ROOT / tidal_argv[1]), overrides)
    optional_deps.check_dependencies(cfg)
    needed = {extra for extra, _, _ in optional_deps.dependencies_of(cfg)}
    assert needed and needed <= extras  # the gsm8k config logs to TensorBoard: the install line has it
    cfg.check_world(2 * 8)  # the recipes' 2 nodes x 8 ranks
    cfg.check_world(1 * 8)  # ... and one node of them (an elastic restart without a lost node)
    assert args.nproc_per_node == "8" and 8 % cfg.engine.tp_size == 0  # rollout TP groups stay in a node


def test_without_the_extra_the_config_would_stop_at_start(monkeypatch):
    """The check above can fail: the gsm8k config without TensorBoard is a config error naming it."""
    from tidal.config_base import ConfigError

    monkeypatch.setattr(optional_deps, "installed_version", lambda dep: None)
    cfg = load_config(str(ROOT / "examples/gsm8k/qwen2.5-1.5b-instruct.yaml"), [])
    with pytest.raises(ConfigError, match="logging backend 'tensorboard' needs tensorboard"):
        optional_deps.check_dependencies(cfg)


def test_the_slurm_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "--shell=bash", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_the_slurm_script_gives_srun_the_cpus_saves_before_the_time_limit_and_leaves_the_interface_alone():
    text = SBATCH.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", text, re.M))
    assert int(directives["cpus-per-task"]) > 1
    assert re.search(r"^export SRUN_CPUS_PER_TASK=\$SLURM_CPUS_PER_TASK$", text, re.M)
    signal, _, before = directives["signal"].partition("@")
    assert signal.removeprefix("B:") in ("TERM", "SIGTERM") and before
    args, _ = parse_launch_args([a.replace('"', "") for a in _sbatch_launch()])
    assert args.shutdown_timeout and int(before) > args.shutdown_timeout  # the save ends before SIGKILL
    assert args.nnodes == "$SLURM_NNODES" and args.max_restarts >= 1
    code = [l for l in text.splitlines() if not l.lstrip().startswith("#")]
    assert not any(re.search(r"(NCCL|GLOO)_SOCKET_IFNAME", l) for l in code), "the interface is the user's to name"


def test_the_manifest_is_a_gang_scheduled_elastic_pytorchjob():
    job, replicas = _pods()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob" and job["metadata"]["name"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    pods = sum(r["replicas"] for r in replicas)
    assert job["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == pods  # all pods or none
    args, _ = parse_launch_args(_manifest_launch())
    assert args.nnodes == f"1:{pods}" and args.max_restarts >= 1  # goes on without a lost pod; it rejoins when back
    for replica in replicas:
        assert replica["restartPolicy"] == "OnFailure"
        spec = replica["template"]["spec"]
        assert spec["schedulerName"] == "volcano"
        assert spec["terminationGracePeriodSeconds"] > args.shutdown_timeout
        (container,) = spec["containers"]
        assert container["image"] and container["resources"]["limits"]["nvidia.com/gpu"] == int(args.nproc_per_node)
        assert not any("SOCKET_IFNAME" in e["name"] for e in container.get("env", []))
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/shared" in mounts and any(o.startswith("run.output_dir=/shared/") for o in container["command"])
