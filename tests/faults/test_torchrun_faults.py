"""2-rank torchrun (gloo, CPU) fault injection through TIDAL_FAULT: a rank SIGKILLed mid-iteration
or mid-checkpoint is restarted by ``torchrun --max-restarts 1`` and the run ends exactly where an
uninterrupted run ends (same metrics, same prompts per step and rank, none twice); a rank that never
enters a collective is reported by the watchdog within run.collective_timeout_s; NaN logprobs on one
rank skip the optimizer step on both, are counted, and K in a row stop the run with a clear error."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DETERMINISTIC = ("reward/", "actor/", "response/", "advantage/", "mismatch/", "kl/")
COMMON = [
    "run.steps=4", "checkpoint.every=2", "checkpoint.keep=3", "optim.lr=1e-3",
    "reward.components.correct.path=tests.faults.rewards:text_hash_reward",
]


def torchrun(out: Path, overrides: list[str], *, fault: str = "", ledger: Path | None = None, max_restarts: int = 0):
    rules = [fault] if fault else []
    if ledger is not None:
        rules.append(f"record@sampled:attempt=any:dir={ledger}")
    env = dict(os.environ, OMP_NUM_THREADS="1", TIDAL_FAULT=";".join(rules))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", str(max_restarts), "-m", "tidal.cli", "train", "quickstart", f"run.output_dir={out}", *overrides,
    ]
    t0 = time.monotonic()
    # a session of its own: on a timeout the whole tree (torchrun and its workers) is killed
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun hung for 300 s; TIDAL_FAULT={env['TIDAL_FAULT']!r}\n{out[-3000:]}\n{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0


def metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(DETERMINISTIC) and not k.endswith("seconds")} for r in rows}


def assert_same_metrics(a: dict[int, dict], b: dict[int, dict]) -> None:
    assert sorted(a) == sorted(b)
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for k, v in a[step].items():  # non-finite values are logged as null
            assert (v is None and b[step][k] is None) or v == pytest.approx(b[step][k], rel=1e-6, abs=1e-9), (step, k)


def ledger(path: Path) -> list[dict]:
    return [json.loads(line) for r in (0, 1) for line in (path / f"rank{r}.jsonl").read_text().splitlines()]


def trained_prompts(rows: list[dict], resumed_from: dict[int, int]) -> dict[tuple[int, int], list[int]]:
    """(step, rank) -> prompt indices that went into the final model: attempt a's records count for
    the steps up to the checkpoint attempt a+1 resumed from; the last attempt's for the rest."""
    last = max(r["attempt"] for r in rows)
    out = {}
    for r in rows:
        if r["attempt"] == last or r["step"] <= resumed_from.get(r["attempt"] + 1, 0):
            out[(r["step"], r["rank"])] = r["data"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_task_overrides):
    out = tmp_path_factory.mktemp("reference")
    proc, _ = torchrun(out, tiny_task_overrides + COMMON, ledger=out / "ledger")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"metrics": metrics(out), "prompts": trained_prompts(ledger(out / "ledger"), {})}


def check_restarted_run(out: Path, proc, reference, *, resumed_from: int) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{resumed_from:06d}'} (step {resumed_from})" in text
    assert_same_metrics(metrics(out), reference["metrics"])
    rows = ledger(out / "ledger")
    assert {r["attempt"] for r in rows} == {0, 1}
    assert sorted({r["step"] for r in rows if r["attempt"] == 1}) == list(range(resumed_from + 1, 5))  # resumed, not restarted
    prompts = trained_prompts(rows, {1: resumed_from})
    assert prompts == reference["prompts"]  # the same prompts for every (step, rank): none skipped
    flat = [i for idx in prompts.values() for i in idx]
    assert len(flat) == len(set(flat)) == 4 * 4  # 4 steps x 4 prompts, none trained twice (one epoch)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"], ckpts


def test_rank_killed_mid_iteration_resumes_exactly(tmp_path, tiny_task_overrides, reference):
    out = tmp_path / "run"
    proc, _ = torchrun(out, tiny_task_overrides + COMMON, fault="kill@stage/train:rank=1:step=3",
                       ledger=out / "ledger", max_restarts=1)
    assert "SIGKILL rank 1 at stage/train step 3" in proc.stdout
    check_restarted_run(out, proc, reference, resumed_from=2)


def test_rank_killed_during_checkpoint_write_resumes_from_previous(tmp_path, tiny_task_overrides, reference):
    out = tmp_path / "run"
    proc, _ = torchrun(out, tiny_task_overrides + COMMON, fault="kill@checkpoint/shards:rank=1:step=4",
                       ledger=out / "ledger", max_restarts=1)
    assert "SIGKILL rank 1 at checkpoint/shards step 4" in proc.stdout
    check_restarted_run(out, proc, reference, resumed_from=2)


def test_collective_never_entered_is_reported_by_the_watchdog(tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    timeout_s = 4.0
    proc, wall = torchrun(out, tiny_task_overrides + COMMON + [f"run.collective_timeout_s={timeout_s}"],
                          fault="hang@stage/reward:rank=1:step=2")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "exitcode  : 3" in text, text[-4000:]  # the watchdog ended rank 0, not gloo's own timeout
    assert "[tidal.watchdog] ranks diverged" in text
    assert "rank 1: step 2, in stage 'reward'" in text and "<- behind" in text
    assert "diverged (behind): ranks [1]" in text
    report = json.loads((out / "heartbeat" / "divergence.json").read_text())
    assert report["behind"] == [1]
    r0, r1 = report["ranks"]
    assert r0["step"] == 2 and r0["stage"] != "reward" and not r0["behind"]
    assert r1["step"] == 2 and r1["stage"] == "reward" and r1["state"] == "in" and r1["behind"]
    assert timeout_s * 0.5 < r1["seconds"] <= timeout_s + 1.0  # reported within the timeout of rank 1 stopping
    assert wall < 200


def _model_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir / "models"), str(out))
    sd = torch.load(out, weights_only=True)
    return {k: v for k, v in sd["actor"]["model"].items()}


def test_nan_logprobs_on_one_rank_skip_on_all_and_stop_after_k(tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    overrides = tiny_task_overrides + COMMON + [
        "run.steps=6", "checkpoint.every=1", "checkpoint.keep=10", "train.max_skipped_steps_in_a_row=2",
        "algorithm.kl_coef=0.05", "algorithm.kl_controller=adaptive", "algorithm.kl_target=0.01",
    ]
    proc, _ = torchrun(out, overrides, fault="nan@policy_logp:rank=1:step=2;nan@policy_logp:rank=1:step=4-")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "2 optimizer steps in a row had a non-finite gradient norm (train.max_skipped_steps_in_a_row=2)" in text, text[-4000:]
    m = metrics(out)
    assert sorted(m) == [1, 2, 3, 4]  # step 5 failed before logging; steps 1-4 are kept
    assert [m[s]["actor/skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 1.0]
    assert [m[s]["actor/skipped_total"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 2.0]
    assert m[1]["actor/grad_norm"] > 0 and m[3]["actor/grad_norm"] > 0
    assert m[2]["actor/grad_norm"] is None and m[4]["actor/grad_norm"] is None  # NaN, logged as null
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == [f"step_{s:06d}" for s in (1, 2, 3, 4)], ckpts
    w1, w2, w3 = (_model_tensors(out / "checkpoints" / f"step_{s:06d}") for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the skipped step changed no weight, on any shard
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # the next step trained normally
    kl_coef = [json.loads((out / "checkpoints" / f"step_{s:06d}" / "trainer.json").read_text())["algorithm"]["kl_coef"] for s in (1, 2, 3, 4)]
    assert all(c == c for c in kl_coef), kl_coef  # a skipped step does not feed NaN to the KL controller
