"""Resume with a changed config (issue 35 item 6): the run compares its config with the one the
checkpoint was trained with (the run's ``config.yaml``, kept in every checkpoint). What may change
(``optim.lr``, ``algorithm.kl_coef``, ``run.steps``, logging, eval cadence, ...) changes and is said
in one line; what may not (the seed, the data, the batch shape) is a config error naming the key,
exit 2, one line; a training set whose size changed under the same config is a config error at
``data.train``. Nothing is silently ignored: a changed ``optim.lr`` or ``algorithm.kl_coef`` is
what the next step uses (loading the optimizer and the KL controller restored the old values)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tidal.cli import main
from tidal.config_base import ConfigError
from tidal.run import checkpoint as ckpt
from tidal.run.resume import ResumePoint, check_config_change, config_changes


def _point(tmp_path: Path, saved: dict) -> ResumePoint:
    path = tmp_path / "step_000004"
    path.mkdir()
    (path / ckpt.CONFIG_RECORD).write_text(yaml.safe_dump(saved))
    return ResumePoint(path=path, step=4)


SAVED = {"run": {"seed": 1, "steps": 4}, "optim": {"lr": 1e-3}, "rollout": {"prompts_per_step": 4, "n_samples": 4},
         "data": {"train": ["a.jsonl"], "eval": [], "shuffle": True}, "task": {"num_train": 80, "workdir": "w"},
         "checkpoint": {"resume": "auto"}}


def _with(**changes) -> dict:
    cfg = json.loads(json.dumps(SAVED))
    for key, value in changes.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


def test_what_may_change_changes_and_is_said_in_one_line(tmp_path, capsys):
    point = _point(tmp_path, SAVED)
    now = _with(optim__lr=2e-3, run__steps=8, data__eval=["e.jsonl"], task__workdir="elsewhere", checkpoint__resume=str(point.path))
    changes = check_config_change(point, now, is_main=True)
    assert changes == {"data.eval": ([], ["e.jsonl"]), "optim.lr": (1e-3, 2e-3), "run.steps": (4, 8), "task.workdir": ("w", "elsewhere")}
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[tidal] resume: changed since the checkpoint of step 4, applied from step 5: data.eval [] -> ['e.jsonl'], "
                   "optim.lr 0.001 -> 0.002, run.steps 4 -> 8, task.workdir 'w' -> 'elsewhere'"], out
    assert check_config_change(point, SAVED, is_main=True) == {} and capsys.readouterr().out == ""  # nothing changed: nothing said


@pytest.mark.parametrize("key,value", [("run__seed", 2), ("rollout__prompts_per_step", 8), ("rollout__n_samples", 2),
                                       ("data__train", ["b.jsonl"]), ("data__shuffle", False), ("task__num_train", 60)])
def test_what_may_not_change_is_a_config_error_naming_the_key(tmp_path, key, value):
    point = _point(tmp_path, SAVED)
    with pytest.raises(ConfigError) as info:
        check_config_change(point, _with(**{key: value}), is_main=True)
    dotted = key.replace("__", ".")
    assert info.value.key == dotted and f"the checkpoint {point.path} was trained with" in info.value.message
    assert "\n" not in str(info.value)


def test_a_checkpoint_without_its_config_has_nothing_to_compare(tmp_path):
    path = tmp_path / "step_000001"
    path.mkdir()
    assert check_config_change(ResumePoint(path=path, step=1), SAVED, is_main=True) == {}
    assert check_config_change(None, SAVED, is_main=True) == {}
    assert config_changes({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == {"a.c": (None, 2)}


def test_a_relative_and_an_absolute_path_naming_one_folder_are_no_change(tmp_path, monkeypatch, capsys):
    """Issue 48 item 5: a restart that names the run directory (or the data, the model) by its
    absolute path where the first run named it relative to the working directory changes nothing;
    another folder still does (and data.train stays fixed)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    saved = {**SAVED, "run": {**SAVED["run"], "output_dir": "runs/x"}, "model": {"path": "~/m"},
             "data": {**SAVED["data"], "train": [{"path": "d/a.jsonl", "weight": 1.0}]}}
    point = _point(tmp_path, saved)
    same = {**saved, "run": {**saved["run"], "output_dir": str(tmp_path / "runs" / "x") + "/"},
            "model": {"path": str(tmp_path / "home" / "m")},
            "data": {**saved["data"], "train": [{"path": str(tmp_path / "d" / "a.jsonl"), "weight": 1.0}]}}
    assert check_config_change(point, same, is_main=True) == {} and capsys.readouterr().out == ""
    other = {**same, "run": {**same["run"], "output_dir": str(tmp_path / "runs" / "y")}}
    assert check_config_change(point, other, is_main=True) == {"run.output_dir": ("runs/x", str(tmp_path / "runs" / "y"))}
    moved = {**same, "data": {**same["data"], "train": [{"path": str(tmp_path / "e" / "a.jsonl"), "weight": 1.0}]}}
    with pytest.raises(ConfigError) as info:
        check_config_change(point, moved, is_main=True)
    assert info.value.key == "data.train"


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow  # about 40 s: three short RL runs on the tiny task and two refused starts
def test_rl_resume_applies_a_changed_lr_and_kl_coef_and_refuses_a_changed_seed(tmp_path, tiny_task_overrides, capsys):
    out = tmp_path / "run"
    common = ["quickstart", *tiny_task_overrides, f"run.output_dir={out}", "checkpoint.every=2", "optim.lr=1e-3"]
    assert main(["train", *common, "run.steps=2"]) == 0
    assert (out / "checkpoints" / "step_000002" / ckpt.CONFIG_RECORD).is_file()
    capsys.readouterr()
    # the seed or the batch shape: exit 2, one line naming the key, nothing trained
    for changed, key in (("run.seed=7", "run.seed"), ("rollout.prompts_per_step=8", "rollout.prompts_per_step")):
        assert main(["train", *common, "run.steps=3", changed]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"tidal: config error at '{key}'") and "set it back to" in err[-1], err
    assert sorted(_metrics(out)) == [1, 2]
    # lr and the KL coefficient: said, and used from step 3 on
    assert main(["train", *common, "run.steps=3", "optim.lr=2e-3", "algorithm.kl_coef=0.25"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "changed since the checkpoint" in line]
    assert said == ["[tidal] resume: changed since the checkpoint of step 2, applied from step 3: algorithm.kl_coef "
                    "0.0 -> 0.25, optim.lr 0.001 -> 0.002, run.steps 2 -> 3"], said
    metrics = _metrics(out)
    assert metrics[2]["actor/lr"] == pytest.approx(1e-3) and metrics[3]["actor/lr"] == pytest.approx(2e-3), metrics
    state = json.loads((out / "checkpoints" / "step_000003" / "trainer.json").read_text())
    assert state["algorithm"]["kl_coef"] == 0.25 and state["algorithm"]["kl_coef_config"] == 0.25, state["algorithm"]


@pytest.mark.slow  # about 30 s: two short RL runs on a copy of the tiny task's data
@pytest.mark.parametrize("change", ["fewer rows", "rows reordered"])
def test_rl_resume_with_other_training_data_names_data_train(tmp_path, tiny_task_overrides, capsys, change):
    """A training set of another size, or (issue 44 item 8) the same rows reordered, under the same
    config: a config error at ``data.train``; the reordered one went on silently on other prompts."""
    from tidal.config import load_config
    from tidal.tasks.assets import prepare

    assets = prepare(load_config("quickstart", tiny_task_overrides).task)
    train = tmp_path / "train.jsonl"
    shutil.copy(assets.train_path, train)
    out = tmp_path / "run"
    common = ["quickstart", *tiny_task_overrides, "task.name=", f"model.path={assets.model_path}", f"data.train=[{{path: {train}}}]",
              f"run.output_dir={out}", "checkpoint.every=2"]
    common = [o for o in common if not o.startswith("task.") or o == "task.name="]
    assert main(["train", *common, "run.steps=2"]) == 0
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(lines[:-8] if change == "fewer rows" else lines[1:] + lines[:1]))  # same config
    capsys.readouterr()
    assert main(["train", *common, "run.steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tidal: config error at 'data.train'"), err
    assert ("num_items" if change == "fewer rows" else "rows were changed or reordered") in err[-1], err


def _trained(optim, total_steps: int, steps: int):
    import torch

    from tidal.strategy.base import TrainState, lr_lambda

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))
    for _ in range(steps):
        opt.step()
        sched.step()
    return TrainState(model=model, optimizer=opt, scheduler=sched, max_grad_norm=1.0)


def test_apply_optim_settings_keeps_an_unchanged_state_exact_and_applies_a_changed_lr():
    from tidal.strategy.base import apply_optim_settings
    from tidal.strategy.config import OptimConfig

    optim = OptimConfig(lr=1e-3, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1)
    saved = _trained(optim, total_steps=10, steps=5)
    for lr, betas in ((1e-3, (0.9, 0.999)), (3e-3, (0.8, 0.99))):
        new = OptimConfig(lr=lr, betas=betas, warmup_steps=2, scheduler="cosine", min_lr_ratio=0.1)
        state = _trained(new, total_steps=10, steps=0)
        state.optimizer.load_state_dict(saved.optimizer.state_dict())
        state.scheduler.load_state_dict(saved.scheduler.state_dict())
        apply_optim_settings(state, new, lr=lr)
        expected = lr * saved.scheduler.lr_lambdas[0](saved.scheduler.last_epoch)
        assert state.scheduler.get_last_lr() == [expected] and state.optimizer.param_groups[0]["lr"] == expected
        assert state.optimizer.param_groups[0]["betas"] == betas and state.scheduler.base_lrs == [lr]
        state.scheduler.step()  # the next step follows this run's schedule from the loaded position
        assert state.optimizer.param_groups[0]["lr"] == pytest.approx(saved.scheduler.lr_lambdas[0](6) * lr, rel=1e-12)
    unchanged = _trained(optim, total_steps=10, steps=0)
    unchanged.optimizer.load_state_dict(saved.optimizer.state_dict())
    unchanged.scheduler.load_state_dict(saved.scheduler.state_dict())
    apply_optim_settings(unchanged, optim, lr=optim.lr)
    assert unchanged.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]  # bit for bit


def _torchrun_rm(out: Path, overrides: list[str]):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "tidal.cli", "train",
           "rm_quickstart", f"run.output_dir={out}", *overrides]
    return subprocess.run(cmd, cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # about 90 s: three reward-model runs under torchrun, 2 gloo ranks
def test_two_ranks_refuse_a_changed_seed_and_apply_a_changed_lr(tmp_path, tiny_rm_overrides):
    out = tmp_path / "run"
    common = [*tiny_rm_overrides, "checkpoint.every=2", "optim.scheduler=constant"]
    first = _torchrun_rm(out, common + ["run.steps=2"])
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    refused = _torchrun_rm(out, common + ["run.steps=3", "run.seed=9"])
    assert refused.returncode != 0
    lines = [line for line in refused.stderr.splitlines() if line.startswith("tidal: config error at 'run.seed'")]
    assert len(lines) == 1, refused.stderr[-3000:]  # said once (rank 0), by both ranks' error
    resumed = _torchrun_rm(out, common + ["run.steps=3", "optim.lr=6e-3"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    said = [line for line in resumed.stdout.splitlines() if "changed since the checkpoint" in line]
    assert said == ["[tidal] resume: changed since the checkpoint of step 2, applied from step 3: optim.lr 0.003 -> 0.006, "
                    "run.steps 2 -> 3"], resumed.stdout[-3000:]
    metrics = _metrics(out)
    assert metrics[2]["train/lr"] == pytest.approx(3e-3) and metrics[3]["train/lr"] == pytest.approx(6e-3), metrics


@pytest.mark.parametrize("left", ["checkpoint", "metrics"])
def test_resume_never_in_a_directory_holding_an_earlier_run_is_refused(tmp_path, left):
    """Issue 44 item 2: ``resume: never`` over a finished run deleted its metrics, then rotated the
    new run's checkpoints away (the older run's higher steps were kept), and a later ``auto``
    continued the old run. A config error naming the directory and the choices; nothing touched."""
    from tidal.distributed import shutdown
    from tidal.distributed.runtime import init_runtime
    from tidal.run.config import CheckpointConfig
    from tidal.run.run_dir import claim_run_dir

    run = tmp_path / "run"
    rt = init_runtime(1, "cpu")
    try:
        if left == "checkpoint":
            ckpt.save_checkpoint(ckpt.checkpoint_root(str(run)), 9, model_states={"m": {"w": torch.ones(4)}}, runtime=rt, keep=2,
                                 trainer_state={"step": 9, "sampler": {}, "algorithm": {}, "trainer": {}})
        else:
            run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        files = lambda: sorted(p.relative_to(run) for p in run.rglob("*") if p.is_file())  # noqa: E731
        before = files()
        with pytest.raises(ConfigError) as info:
            claim_run_dir(str(run), CheckpointConfig(resume="never"), rt)
        assert info.value.key == "checkpoint.resume" and f"{run} holds an earlier run" in info.value.message
        assert ("step_000009" in info.value.message) == (left == "checkpoint")
        assert "checkpoint.resume=auto" in info.value.message and "another run.output_dir" in info.value.message
        assert files() == before and (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
        claim_run_dir(str(tmp_path / "fresh"), CheckpointConfig(resume="never"), rt).lock.release()  # an empty directory: fine
    finally:
        shutdown()
