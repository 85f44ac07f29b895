"""Runs that used to go wrong without a word (issue 35 item 7):

- a group-baseline estimator (GRPO, RLOO, CPGD, REINFORCE++ with baseline) with rollout.n_samples: 1
  gives every sample advantage 0: `tidal train` and `tidal check` warn that the run cannot learn;
- the run directory removed mid-run: the run stops with an error naming it (it ended with exit 0,
  its later checkpoints quietly written into a new directory);
- a reward function calling os.chdir with a relative run.output_dir: checkpoints and metrics still
  go to the directory the run started in (resolved once, at start), and the rerun resumes from them.
"""

import json

import pytest

from tidal import cli
from tidal.config import load_config
from tidal.config_base import ConfigError
from tests.faults import rewards

F = "tests.faults.rewards"


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "cpgd", "reinforce_pp_baseline"])
def test_a_group_baseline_with_one_sample_warns_that_the_run_cannot_learn(advantage, capsys):
    cfg = load_config("quickstart", ["rollout.n_samples=1", f"algorithm.advantage={advantage}"])
    (warning,) = cfg.learning_warnings()
    assert warning.startswith(f"rollout.n_samples is 1 but algorithm.advantage={advantage}") and "cannot learn" in warning
    assert cli.main(["check", "quickstart", "rollout.n_samples=1", f"algorithm.advantage={advantage}"]) == 0
    assert f"[tidal] warning: rollout.n_samples is 1 but algorithm.advantage={advantage}" in capsys.readouterr().out


@pytest.mark.parametrize("overrides", [["rollout.n_samples=1", "algorithm.advantage=reinforce", "algorithm.gamma=1.0"],
                                       ["rollout.n_samples=2"]])
def test_runs_that_can_learn_get_no_warning(overrides):
    assert load_config("quickstart", overrides).learning_warnings() == []


def test_filters_that_leave_no_gradient_or_bias_a_teacher_warn(tmp_path, capsys):
    """rollout.top_k=1: the processed distribution (what the trainer scores) is one token, logprob 0,
    no gradient; filters with distillation compare a cut student with a full teacher."""
    (warning,) = load_config("quickstart", ["rollout.top_k=1"]).learning_warnings()
    assert warning.startswith("rollout.top_k is 1") and "cannot learn" in warning
    assert cli.main(["check", "quickstart", "rollout.top_k=1"]) == 0
    assert "[tidal] warning: rollout.top_k is 1" in capsys.readouterr().out
    teacher = ["algorithm.distill_coef=1.0", f"model.teacher.path={tmp_path}"]
    (warning,) = load_config("quickstart", teacher + ["rollout.top_p=0.9"]).learning_warnings()
    assert warning.startswith("rollout.top_k/top_p/min_p filter the student's distribution")
    assert load_config("quickstart", teacher).learning_warnings() == []
    for ok in (["rollout.top_k=2"], ["rollout.top_p=0.9", "rollout.min_p=0.05"]):
        assert load_config("quickstart", ok).learning_warnings() == []


def test_filters_with_an_engine_that_returns_unfiltered_logprobs_are_refused():
    """SGLang returns logprobs before top-k/top-p/min-p renormalisation: mismatch and its correction
    would compare the trainer's processed distribution with another one, so the run is refused (exit 2)."""
    for f in ("rollout.top_k=5", "rollout.top_p=0.9", "rollout.min_p=0.1"):
        with pytest.raises(ConfigError) as e:
            load_config("quickstart", ["engine.backend=sglang", "engine.cuda_graphs=false", f])
        assert e.value.key == f.split("=")[0] and "engine.backend other than sglang" in str(e.value)


@pytest.mark.slow  # a tiny run of 3 steps
def test_the_run_directory_removed_mid_run_is_an_error(tmp_path, tiny_task_overrides, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.setenv("TIDAL_TEST_RUN_DIR", str(run))
    monkeypatch.setitem(rewards.CALLS, "n", 0)
    code = cli.main(["train", "quickstart", *tiny_task_overrides, f"run.output_dir={run}", "run.steps=3", "checkpoint.every=1",
                     f"reward.components.correct.path={F}:remove_run_dir_at_step_2"])
    err = capsys.readouterr().err
    assert code == 1, err  # was 0, with step 2 and 3's checkpoints in a directory made anew
    assert f"tidal: the run directory {run} was removed or replaced during the run" in err
    assert not (run / "checkpoints" / "step_000002").exists()


@pytest.mark.slow  # two tiny runs of 2 and 3 steps
def test_a_reward_that_changes_directory_does_not_move_the_run(tmp_path, tiny_task_overrides, monkeypatch, capsys):
    start, away = tmp_path / "start", tmp_path / "away"
    start.mkdir()
    away.mkdir()
    monkeypatch.chdir(start)
    monkeypatch.setenv("TIDAL_TEST_CHDIR", str(away))
    common = ["quickstart", *tiny_task_overrides, "run.output_dir=runs/rel", "checkpoint.every=1",
              f"reward.components.correct.path={F}:chdir_away"]
    assert cli.main(["train", *common, "run.steps=2"]) == 0
    assert (start / "runs" / "rel" / "checkpoints" / "step_000002" / "trainer.json").is_file()
    assert not (away / "runs").exists()
    monkeypatch.chdir(start)  # the rerun, from where the first one started
    assert cli.main(["train", *common, "run.steps=3"]) == 0
    assert f"resumed from {start / 'runs' / 'rel' / 'checkpoints' / 'step_000002'} (step 2)" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (start / "runs" / "rel" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.slow  # torchrun, 2 ranks
def test_both_ranks_stop_when_the_run_directory_is_removed(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(repo / "tests" / "faults" / "scripts" / "run_dir_lost.py"), str(run)]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo)), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert f"INTACT rank {r}" in proc.stdout
        assert f"LOST rank {r}: the run directory {run} was removed or replaced during the run" in proc.stdout, proc.stdout


# ---- issue 44 item 3: a run never ends with exit code 0 unless it finished ----
def _tidal(*args: str, env: dict | None = None, timeout: float = 600):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    full_env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], cwd=repo, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_supervising_command_keeps_what_the_child_said_and_names_what_it_did_not(capsys):
    from tidal.run.supervise import _outcome

    assert _outcome("train", 11, 2, "2") == 2 and _outcome("train", 11, 1, "raised") == 1  # said: no second word
    assert capsys.readouterr().err == ""
    assert _outcome("train", 11, 0, "") == 1
    err = capsys.readouterr().err
    assert err.startswith("tidal: the train process (pid 11) ended with exit code 0 before the command finished") and \
        "rerun the same command to resume" in err and err.count("\n") == 1, err
    assert _outcome("eval", 12, 7, "") == 7 and "eval process (pid 12) ended with exit code 7" in capsys.readouterr().err


@pytest.mark.parametrize("signum", [9, 15])
def test_a_child_ended_by_a_signal_ends_the_command_by_the_same_signal(signum):
    """SIGKILL (a crash, the kernel's OOM killer, a fault test's kill) is named; a SIGTERM the command
    passed on is not said twice. Either way the command ends by that signal (torchrun sees it)."""
    import subprocess
    import sys

    code = f"from tidal.run.supervise import _outcome; _outcome('train', 5, -{signum}, '')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signum, proc.stderr
    said = "tidal: the train process (pid 5) was ended by signal SIGKILL before the command finished\n"
    assert proc.stderr == (said if signum == 9 else ""), proc.stderr


def test_a_supervised_config_error_is_one_line_with_its_exit_code():
    proc = _tidal("check", "/no/such/config.yaml", timeout=120)
    assert proc.returncode == 2 and proc.stderr == "tidal: config error at '<config>': config file '/no/such/config.yaml' not found\n", proc.stderr


@pytest.mark.slow  # a tiny run that ends itself in step 2
@pytest.mark.parametrize("fn", ["posix_exits_at_step_2"])
def test_a_reward_that_ends_the_trainer_with_exit_code_0_fails_the_command(tmp_path, tiny_task_overrides, fn):
    """``posix._exit(0)`` in a reward under thread isolation (the ``os._exit`` guard does not see it)
    ended ``tidal train`` with exit code 0, an empty metrics.jsonl and no message."""
    run = tmp_path / "run"
    proc = _tidal("train", "quickstart", *tiny_task_overrides, f"run.output_dir={run}", "run.steps=3",
                  f"reward.components.correct.path={F}:{fn}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tidal: the train process (pid ") and "ended with exit code 0 before the command finished" in last, last
    assert "next steps" not in proc.stdout
