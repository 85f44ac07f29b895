"""At start a run says where it lives (run directory, resolved config, metrics, checkpoints, how to
watch it) and writes the resolved config there; that file loads back to the same config."""

import pytest

from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown


def test_run_announces_its_directory_and_saves_the_resolved_config(tmp_path, tiny_task_overrides, capsys):
    cfg = load_config("quickstart", tiny_task_overrides + [f"run.output_dir={tmp_path}", "logging.backends=[jsonl,tensorboard]"])
    build_trainer(cfg)
    shutdown()
    out = capsys.readouterr().out
    assert f"[tidal] run directory: {tmp_path}" in out
    assert f"resolved config: {tmp_path / 'config.yaml'}" in out and f"metrics: {tmp_path / 'metrics.jsonl'}" in out
    assert f"checkpoints: {tmp_path / 'checkpoints'}" in out
    assert f"tensorboard --logdir {tmp_path / 'tb'}" in out and f"tidal report {tmp_path}" in out
    assert load_config(str(tmp_path / "config.yaml")).to_dict() == cfg.to_dict()


@pytest.mark.slow
def test_a_finished_run_prints_its_next_steps_and_they_work(tmp_path, tiny_task_overrides, capsys):
    """The end of `tidal train` names the report, eval and export commands with the run's real paths
    (the last checkpoint; an export folder beside the run directory), and the eval command runs; the
    step's trajectory file carries what the update trained on."""
    import json
    import shlex

    from tidal import cli

    run_dir = tmp_path / "run"
    overrides = tiny_task_overrides + [f"run.output_dir={run_dir}", "run.steps=1", "logging.trajectories_every=1"]
    assert cli.main(["train", "quickstart", *overrides]) == 0
    out = capsys.readouterr().out
    steps = out.split("[tidal] next steps:\n", 1)[1].splitlines()
    commands = [line.removeprefix("[tidal]   ").split("    #")[0] for line in steps]
    assert commands[0] == f"tidal report {run_dir}"
    last = run_dir / "checkpoints" / "step_000001"
    assert commands[1] == shlex.join(["tidal", "eval", "quickstart", *overrides, "--checkpoint", str(last)])
    assert commands[2].endswith(f"--checkpoint {last} --out {tmp_path / 'run_hf'}")
    assert cli.main(shlex.split(commands[1])[1:]) == 0
    assert "eval/greedy_accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the step's trajectory file holds each row as trained: its sampled tokens' logprobs are the record's
    records = [json.loads(line) for line in (run_dir / "trajectories" / "step_000001.jsonl").read_text().splitlines()]
    for rec in records:
        row = rec["trained"]
        assert len(row["input_ids"]) == len(row["action_mask"]) == len(row["advantages"]) == len(row["rollout_logprobs"])
        assert "old_logprobs" not in row  # one optimizer step per rollout: the update's forward supplies them
        assert [lp for lp, m in zip(row["rollout_logprobs"], row["action_mask"]) if m] == rec["rollout_logprobs"]


def test_next_steps_without_a_checkpoint(tmp_path):
    from tidal.run.run_dir import next_steps

    cfg = load_config("quickstart", [f"run.output_dir={tmp_path}", "checkpoint.at_end=false"])
    lines = next_steps(cfg, "quickstart", ["checkpoint.at_end=false"])
    assert lines[1].startswith(f"[tidal]   tidal report {tmp_path}") and "no checkpoint was saved" in lines[2] and len(lines) == 3
