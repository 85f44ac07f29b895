"""The reward-model job runs in the one job loop (issue 33 item 1): it resumes with the RL job's
fall-back (a newest checkpoint that passes the cheap checks but fails to load is skipped for the
older one under ``checkpoint.resume: auto``), and its update is a placement phase (an exception in
the update leaves the optimizer state where it was: offloaded again)."""

import json
from pathlib import Path

import pytest
import torch

from tidal.cli import main
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.rm.setup import build_reward_model_trainer
from tidal.run import checkpoint as ckpt
from tests.faults.old_checkpoints import as_saved_before_checksums

TINY = ["reward_model.task.num_train=16", "reward_model.task.num_eval=8", "reward_model.task.max_digits=2",
        "reward_model.task.hidden_size=32", "reward_model.task.num_layers=1", "reward_model.task.num_heads=2",
        "reward_model.task.num_kv_heads=1", "reward_model.task.intermediate_size=64",
        "reward_model.batch_pairs=8", "eval.every=0", "eval.at_start=false", "eval.at_end=false", "logging.backends=[jsonl]"]


def spoil_a_bytes_item(path: Path) -> None:
    """Zero the bytes of a non-tensor item of the shard (an optimizer hyper-parameter), keeping its
    size: the cheap checks pass, loading fails."""
    md = ckpt.read_dcp_metadata(path / "models")
    info = next(v for k, v in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn) if k.fqn.endswith(".lr"))
    shard = path / "models" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + info.length] = b"\x00" * info.length
    shard.write_bytes(bytes(data))


@pytest.mark.slow  # about 10 s: the task's assets and two short runs
def test_rm_resume_falls_back_past_a_newest_checkpoint_that_fails_to_load(tmp_path, task_workdir, capsys):
    run = tmp_path / "run"
    common = ["rm_quickstart", f"run.output_dir={run}", f"reward_model.task.workdir={task_workdir}", *TINY,
              "checkpoint.every=1", "checkpoint.keep=5"]
    assert main(["train", *common, "run.steps=2"]) == 0
    newest = run / "checkpoints" / "step_000002"
    spoil_a_bytes_item(newest)
    as_saved_before_checksums(newest)  # only loading finds it
    assert ckpt.checkpoint_problems(newest) == []
    capsys.readouterr()
    assert main(["train", *common, "run.steps=3"]) == 0
    captured = capsys.readouterr()
    assert f"checkpoint.resume=auto skips {newest}: loading failed: " in captured.err, captured.err[-2000:]
    assert f"resumed from {run / 'checkpoints' / 'step_000001'} (step 1)" in captured.out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps


def test_an_exception_in_the_rm_update_leaves_the_optimizer_state_offloaded(tmp_path, task_workdir):
    cfg = load_config("rm_quickstart", [f"run.output_dir={tmp_path / 'run'}", f"reward_model.task.workdir={task_workdir}",
                                        *TINY, "checkpoint.every=0", "checkpoint.at_end=false", "run.steps=2",
                                        "strategy.offload_optimizer=true"])
    try:
        trainer = build_reward_model_trainer(cfg)
        strategy, moves = trainer.strategy, []
        for name in ("reload_optimizer", "offload_optimizer"):
            inner = getattr(strategy, name)
            setattr(strategy, name, lambda state, inner=inner, name=name: (moves.append(name), inner(state))[1])

        def failing_step(state):
            raise RuntimeError("boom in the optimizer step")

        strategy.optimizer_step = failing_step
        with pytest.raises(RuntimeError, match="boom in the optimizer step"):
            trainer.fit()
        assert moves == ["reload_optimizer", "offload_optimizer"], moves
        assert trainer.model_state.optimizer_offloaded
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in trainer.model.parameters())
    finally:
        shutdown()
