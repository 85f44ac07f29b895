"""`tidal eval` and `tidal export` only read a run (issue 35 item 2, issue 34 item 7): on a finished
run they write nothing into its directory (metrics.jsonl, config.yaml, checkpoints, no lock, no
heartbeat), run while the training run still holds its lock, take the run's own config.yaml beside
the checkpoint (the training overrides need not be repeated: a CONFIG with another batch size
used to fail with `sampler state ... global_batch_size`), and print only what they do."""

import json
import os
from pathlib import Path

import pytest

from tidal.cli import main
from tidal.run.run_lock import acquire_run_lock


def _snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a 2-step tiny run, then eval and export
def test_eval_and_export_leave_the_run_directory_as_it_was(tmp_path, capsys, tiny_task_overrides):
    run = tmp_path / "run"
    train = ["quickstart", *tiny_task_overrides, f"run.output_dir={run}", "checkpoint.every=1", "checkpoint.keep=2",
             "rollout.prompts_per_step=2"]  # an override the later commands do not repeat
    assert main(["train", *train, "run.steps=2"]) == 0
    capsys.readouterr()
    before = _snapshot(run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    ckpt = run / "checkpoints" / "step_000001"
    with acquire_run_lock(run, 0):  # a training run still holding the directory does not stop them
        before = _snapshot(run)
        assert main(["eval", "--checkpoint", str(ckpt), "eval.max_prompts=4"]) == 0
        out = capsys.readouterr().out
        assert main(["export", "quickstart", *tiny_task_overrides, "--checkpoint", str(ckpt), "--out",
                     str(tmp_path / "hf")]) == 0  # the README's form, without the run's overrides
        exported = capsys.readouterr().out
        assert _snapshot(run) == before  # nothing in the run directory written, rewritten or removed
    assert f"evaluating the actor of checkpoint {ckpt} (step 1; the run's config {run / 'config.yaml'}) on 4 eval prompts" in out
    assert json.loads(out.strip().splitlines()[-1])["step"] == 1
    for said in (out, exported):  # the training run's lines are not theirs to print
        assert "run directory" not in said and "watch:" not in said and "training prompts" not in said
    assert f"exported the actor of checkpoint {ckpt} (step 1) to {(tmp_path / 'hf').resolve()}" in exported
    assert not (run / "heartbeat").exists() and not os.path.exists(run / ".tidal.lock")
    from tests.faults.disks import tmpfs

    with tmpfs(tmp_path / "disk", "16k") as disk:  # issue 44 item 10: a full disk was a raw SafetensorError traceback
        capsys.readouterr()
        assert main(["export", "--checkpoint", str(ckpt), "--out", str(disk / "hf")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"tidal: writing the export {disk / 'hf'} failed: ") and "the disk is full" in err, err
        assert err.count("\n") == 1 and sorted(p.name for p in disk.iterdir()) == []  # its partial copy removed
