"""The reward-model job under `torchrun --nproc_per_node 2` on CPU (gloo), through the same entry
point as RL (`python -m tidal.cli train`): FSDP2 and DeepSpeed ZeRO-3 give the same losses,
gradient norms, accuracies and export; a rank SIGKILLed mid-run is restarted by torchrun, resumes
from the newest checkpoint and ends exactly where an uninterrupted run ends, each step and rank
training on the same pairs; a SIGTERM on one rank stops both after the same step with a checkpoint
(exit 75), and the rerun ends where the uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tidal.run.stop import EXIT_CODE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
COMMON = ["run.steps=4", "checkpoint.every=2", "checkpoint.keep=3", "eval.every=2", "reward_model.batch_pairs=8",
          "train.micro_batch_tokens=64"]  # several micro-batches per step and rank
BACKENDS = {"fsdp2": [], "deepspeed": ["strategy.backend=deepspeed", "strategy.zero_stage=3"]}


def torchrun(out: Path, overrides: list[str], *, fault: str = "", max_restarts: int = 0, check: bool = True) -> subprocess.CompletedProcess:
    rules = [f"record@sampled:attempt=any:dir={out / 'ledger'}"] + ([fault] if fault else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TIDAL_FAULT=";".join(rules))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", str(max_restarts),
           "-m", "tidal.cli", "train", "rm_quickstart", f"run.output_dir={out}", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun hung\n{stdout[-3000:]}\n{stderr[-5000:]}")
    assert proc.returncode == 0 or not check, stdout[-3000:] + stderr[-5000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(("train/", "eval/", "data/"))} for r in rows}


def trained_pairs(out: Path) -> dict[tuple[int, int], list[int]]:
    """(step, rank) -> pair indices of the attempt whose update of that step survived."""
    rows = [json.loads(line) for r in (0, 1) for line in (out / "ledger" / f"rank{r}.jsonl").read_text().splitlines()]
    last = max(r["attempt"] for r in rows)
    resumed = 2 if last > 0 else 4  # the restarted attempt resumed from the step-2 checkpoint
    return {(r["step"], r["rank"]): r["data"] for r in rows if r["attempt"] == last or r["step"] <= resumed}


def assert_close(a: dict[int, dict], b: dict[int, dict], rel: float) -> None:
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for k, v in a[step].items():
            assert v == pytest.approx(b[step][k], rel=rel, abs=1e-7), (step, k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_rm_overrides):
    """One uninterrupted 2-rank run per backend."""
    out = {}
    for name, extra in BACKENDS.items():
        out[name] = tmp_path_factory.mktemp(name)
        proc = torchrun(out[name], tiny_rm_overrides + COMMON + extra)
        assert "reward-model eval at start" in proc.stdout and "exported the reward model of step" in proc.stdout
    return out


def test_fsdp2_and_deepspeed_agree(runs):
    a, b = metrics(runs["fsdp2"]), metrics(runs["deepspeed"])
    assert_close(a, b, rel=1e-5)
    assert all(a[s]["train/grad_norm"] > 0 for s in a) and a[4]["data/eval_pairs"] == 32
    assert trained_pairs(runs["fsdp2"]) == trained_pairs(runs["deepspeed"])
    ea, eb = load_file(runs["fsdp2"] / "export" / "model.safetensors"), load_file(runs["deepspeed"] / "export" / "model.safetensors")
    assert ea.keys() == eb.keys() and "score.weight" in ea
    assert max((ea[k] - eb[k]).abs().max().item() for k in ea) < 1e-4


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_killed_rank_resumes_exactly(runs, tmp_path, tiny_rm_overrides, backend):
    out = tmp_path / "killed"
    proc = torchrun(out, tiny_rm_overrides + COMMON + BACKENDS[backend], fault="kill@stage/train:rank=1:step=3", max_restarts=1)
    assert "resumed from" in proc.stdout and "step_000002" in proc.stdout
    assert_close(metrics(out), metrics(runs[backend]), rel=1e-6)
    pairs = trained_pairs(out)
    assert pairs == trained_pairs(runs[backend])
    per_epoch = 96 // 8  # 12 steps per epoch: four steps never repeat a pair
    seen = [i for v in pairs.values() for i in v]
    assert len(seen) == len(set(seen)) == 4 * 8 and per_epoch > 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000004"]


def test_sigterm_stops_every_rank_after_the_same_step_and_the_rerun_resumes(runs, tmp_path, tiny_rm_overrides):
    out = tmp_path / "stopped"
    overrides = tiny_rm_overrides + COMMON
    proc = torchrun(out, overrides, fault="sigterm@stage/train:rank=1:step=3", check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode  : {EXIT_CODE}" in text, text[-4000:]
    assert "stopped by SIGTERM: checkpoint of step 3 saved" in text
    assert sorted(metrics(out)) == [1, 2, 3] and (out / "checkpoints" / "step_000003" / "trainer.json").is_file()
    resumed = torchrun(out, overrides)
    assert "resumed from" in resumed.stdout and "step_000003" in resumed.stdout
    assert_close(metrics(out), metrics(runs["fsdp2"]), rel=1e-6)
