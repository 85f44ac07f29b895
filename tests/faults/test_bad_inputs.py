"""Bad input in a world of one: an unwritable run/checkpoint directory, a missing model or data
path, a tokenizer without a chat template and malformed rows fail at start with an error naming the
thing (a ConfigError naming the key through ``tidal train``: exit code 2, one line); a reward that
turns NaN, has the wrong length or whose server is down raises naming the component (``on_error:
raise``) or drops and counts the samples (``on_error: drop``), and the steps already trained stay."""

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch

from tidal import cli
from tidal.build import build_trainer
from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.distributed import shutdown
from tidal.rewards.base import RewardError
from tidal.run import checkpoint as ckpt
from tests.faults import rewards

HASH = "reward.components.correct.path=tests.faults.rewards:text_hash_reward"


@pytest.fixture(autouse=True)
def _teardown_process_group():
    yield
    shutdown()


@pytest.fixture(scope="module")
def assets(tiny_task_overrides):
    from tidal.tasks import prepare

    return prepare(load_config("quickstart", tiny_task_overrides).task)


def _no_task(overrides: list[str]) -> list[str]:
    """``overrides`` without the task's settings (a run on its own paths reads none of them)."""
    return [o for o in overrides if not o.startswith("task.")]


def _own_paths(assets, tmp_path, **changes) -> list[str]:
    """Overrides for a run on explicit model/data paths (no task), copies of the task's assets."""
    model = tmp_path / "model"
    shutil.copytree(assets.model_path, model)
    train = tmp_path / "train.jsonl"
    shutil.copy(assets.train_path, train)
    return ["task.name=", f"model.path={changes.get('model', model)}", f"data.train=[{{path: {changes.get('train', train)}}}]"]


def _cli_error(capsys, overrides: list[str], *, loads_models: bool = True, command: str = "train") -> str:
    assert cli.main([command, "quickstart", *overrides]) == 2
    text = capsys.readouterr().err
    err = text.strip().splitlines()[-1]
    assert err.startswith("tidal: config error at") and "Traceback" not in text, text  # one line, no traceback
    assert loads_models or "Loading weights" not in text, text  # found before any model was loaded
    return err


def test_unwritable_checkpoint_dir_fails_at_start(tmp_path, tiny_task_overrides, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a file where the checkpoint directory should be")
    err = _cli_error(capsys, tiny_task_overrides + [f"run.output_dir={out}", "checkpoint.every=1"], loads_models=False)
    assert "'run.output_dir'" in err and f"cannot write to {out / 'checkpoints'}" in err
    assert not (out / "metrics.jsonl").exists()  # nothing trained, nothing to lose


def test_unwritable_run_dir_fails_at_start(tiny_task_overrides, capsys, tmp_path):
    # a plain file where a folder of the path must be: uncreatable even for root (/proc itself is
    # refused earlier, as a system folder: tests/faults/test_output_dir.py)
    (tmp_path / "a-file").write_text("")
    err = _cli_error(capsys, tiny_task_overrides + [f"run.output_dir={tmp_path}/a-file/run"], loads_models=False)
    assert "'run.output_dir'" in err and f"cannot create {tmp_path}/a-file/run" in err


def test_too_little_disk_space_for_a_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)  # 8 parameters: weights + two AdamW moments in fp32
    assert ckpt.checkpoint_bytes([model]) == 8 * 12
    ckpt.check_free_space(tmp_path, ckpt.checkpoint_bytes([model]))
    with pytest.raises(ConfigError, match=rf"'run.output_dir'.*{tmp_path} has .* GiB free but the checkpoints of this run need about"):
        ckpt.check_free_space(tmp_path, 1 << 62)


def test_missing_model_path(tmp_path, assets, tiny_task_overrides, capsys):
    err = _cli_error(capsys, _no_task(tiny_task_overrides) + [f"run.output_dir={tmp_path / 'run'}"] + _own_paths(assets, tmp_path, model="/no/such/model"), loads_models=False)
    assert "'model.path'" in err and "'/no/such/model' is not a local directory" in err


def test_missing_data_path(tmp_path, assets, tiny_task_overrides, capsys):
    err = _cli_error(capsys, _no_task(tiny_task_overrides) + [f"run.output_dir={tmp_path / 'run'}"] + _own_paths(assets, tmp_path, train="/no/such.jsonl"), loads_models=False)
    assert "'data.train[0].path'" in err and "'/no/such.jsonl' does not exist" in err


def test_resume_from_a_missing_checkpoint(tmp_path, tiny_task_overrides, capsys):
    err = _cli_error(capsys, tiny_task_overrides + [f"run.output_dir={tmp_path / 'run'}", f"checkpoint.resume={tmp_path / 'nope'}"], loads_models=False)
    assert "'checkpoint.resume'" in err and "is not a complete Tidal checkpoint" in err


def test_tokenizer_without_chat_template(tmp_path, assets, tiny_task_overrides, capsys):
    overrides = _no_task(tiny_task_overrides) + [f"run.output_dir={tmp_path / 'run'}"] + _own_paths(assets, tmp_path)
    model = tmp_path / "model"
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg_file = model / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(tok_cfg))
    err = _cli_error(capsys, overrides, loads_models=False)
    assert "'data.apply_chat_template'" in err and "tokenizer has no chat template" in err


def test_tokenizer_without_pad_and_eos_tokens(tmp_path, assets, tiny_task_overrides, capsys):
    """Qwen2Tokenizer then invents '<|endoftext|>' as a token past the model's embedding: that used to
    be an IndexError in the first generation; now an error at start naming the token."""
    overrides = _no_task(tiny_task_overrides) + [f"run.output_dir={tmp_path / 'run'}"] + _own_paths(assets, tmp_path)
    cfg_file = tmp_path / "model" / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    for k in ("pad_token", "eos_token"):
        tok_cfg.pop(k, None)
    cfg_file.write_text(json.dumps(tok_cfg))
    err = _cli_error(capsys, overrides, loads_models=False)
    assert "'model.tokenizer_path'" in err and "'<|endoftext|>' (id " in err and "have none" in err, err


@pytest.mark.parametrize("bad_line, message", [
    ('{"prompt": "1+1=", "reference": 2', r"train.jsonl:3: invalid JSON"),
    ('{"question": "1+1="}', r"train.jsonl:3: a row needs exactly one of 'prompt' or 'messages', it has neither"),
    ('[1, 2]', r"train.jsonl:3: a row must be a JSON object, got list"),
    # issue 44 item 1: under isolation: process such a row stalled a step for 125 s, then a raw RuntimeError
    ('{"prompt": "1+1=", "reference": 2, "meta": ' + '[' * 150 + ']' * 150 + '}',
     r"train.jsonl:3: a field nests lists/objects deeper than 100 levels"),
])
def test_malformed_row_names_file_and_line(tmp_path, assets, tiny_task_overrides, bad_line, message):
    overrides = _no_task(tiny_task_overrides) + [f"run.output_dir={tmp_path / 'run'}"] + _own_paths(assets, tmp_path)
    train = tmp_path / "train.jsonl"
    lines = train.read_text().splitlines()
    train.write_text("\n".join(lines[:2] + [bad_line] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match=message):
        build_trainer(load_config("quickstart", overrides))


def _run(out: Path, tiny, extra: list[str]):
    cfg = load_config("quickstart", tiny + [f"run.output_dir={out}", "checkpoint.every=1", "checkpoint.keep=5", "optim.lr=1e-3", *extra])
    return build_trainer(cfg).fit()


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_reward_turning_nan_raises_and_keeps_trained_steps(tmp_path, tiny_task_overrides, capsys):
    out = tmp_path / "run"
    rewards.CALLS["n"] = 0
    with pytest.raises(RewardError, match=r"component 'correct' failed on sample 0: function '.*nan_from_third_step' returned nan, expected a finite number"):
        _run(out, tiny_task_overrides, ["run.steps=4", "reward.components.correct.path=tests.faults.rewards:nan_from_third_step"])
    assert [r["step"] for r in _steps(out)] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    shutdown()
    capsys.readouterr()
    # and, as if the process had also been killed re-saving step 2 (step_000002 moved aside):
    (out / "checkpoints" / "step_000002").rename(out / "checkpoints" / "step_000002.old")
    _run(out, tiny_task_overrides, ["run.steps=3", HASH])  # fixed reward: the run continues from step 2
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} (step 2)" in capsys.readouterr().out
    assert [r["step"] for r in _steps(out)] == [1, 2, 3]


def test_reward_nan_dropped_and_counted(tmp_path, tiny_task_overrides):
    out = tmp_path / "run"
    m = _run(out, tiny_task_overrides, ["run.steps=2", "reward.on_error=drop", "reward.components.correct.path=tests.faults.rewards:nan_on_odd_index"])
    for row in _steps(out):  # 4 prompts x 4 samples a step, the odd-indexed half is NaN
        assert (row["reward/dropped_count"], row["reward/total/count"], row["reward/correct/errors_count"]) == (8.0, 8.0, 8.0)
        assert row["actor/skipped"] == 0.0 and row["actor/loss"] is not None
    assert m["actor/grad_norm"] > 0


def test_reward_wrong_length_raises(tmp_path, tiny_task_overrides):
    with pytest.raises(RewardError, match=r"component 'correct' failed on sample 0: batched function '.*wrong_length_batched' returned 15 values for 16 samples"):
        _run(tmp_path / "run", tiny_task_overrides, ["run.steps=1", "reward.components.correct.path=tests.faults.rewards:wrong_length_batched"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("on_error", ["raise", "drop"])
def test_reward_server_down(tmp_path, tiny_task_overrides, on_error):
    url = f"http://127.0.0.1:{_closed_port()}"
    remote = f"reward.components.correct={{type: remote, url: '{url}', max_retries: 1, backoff_s: 0.01, max_backoff_s: 0.01, timeout_s: 2}}"
    extra = ["run.steps=1", remote, f"reward.on_error={on_error}"]
    if on_error == "raise":
        with pytest.raises(RewardError, match=rf"remote reward {url}/v1/score: failed after 2 attempts; last: Client\w*Error"):
            _run(tmp_path / "run", tiny_task_overrides, extra)
        return
    _run(tmp_path / "run", tiny_task_overrides, extra)
    (row,) = _steps(tmp_path / "run")
    assert (row["reward/dropped_count"], row["reward/total/count"]) == (16.0, 0.0)
    # scored while decoding: one request per group as it ends (4 groups of 4), each failed after its one retry
    assert row["reward/correct/failed_requests_count"] == 4.0 and row["reward/correct/retries_count"] == 4.0
    assert row["actor/skipped"] == 0.0 and row["actor/grad_norm"] == 0.0  # nothing to learn from, nothing corrupted


# ---- `tidal check` reads the data against the config, and `tidal train` runs the same check ----------

def _check_error(capsys, overrides: list[str], command: str = "check") -> str:
    """The one line of a config error of ``tidal COMMAND quickstart OVERRIDES`` (exit 2, no traceback,
    no model loaded)."""
    return _cli_error(capsys, overrides, loads_models=False, command=command)


def _own(tmp_path, assets, tiny, *extra) -> list[str]:
    return _no_task(tiny) + [f"run.output_dir={tmp_path / 'run'}"] + _own_paths(assets, tmp_path) + list(extra)


def _rewrite_row(path: Path, line_no: int, change) -> None:
    lines = path.read_text().splitlines()
    lines[line_no - 1] = json.dumps(change(json.loads(lines[line_no - 1])))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_row_without_the_prompt_field_names_file_row_and_key(tmp_path, assets, tiny_task_overrides, capsys, command):
    overrides = _own(tmp_path, assets, tiny_task_overrides)
    _rewrite_row(tmp_path / "train.jsonl", 2, lambda row: {"question": row.pop("prompt"), **row})
    err = _check_error(capsys, overrides, command)
    assert "'data.prompt_key'" in err and f"{tmp_path / 'train.jsonl'}:2:" in err, err
    assert "its fields: 'label', 'question', 'reference'" in err and "set data.prompt_key" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()  # a train stopped by a data error leaves no empty folder (issue 44 item 15)


def test_a_label_that_is_no_recipe_is_found_before_loading(tmp_path, assets, tiny_task_overrides, capsys):
    """The README's `gsm8k` recipe on data labelled otherwise: was 78 lines after the model loaded."""
    overrides = _own(tmp_path, assets, tiny_task_overrides, "reward.recipes={gsm8k: [[correct, 1.0]]}")
    err = _check_error(capsys, overrides, "train")
    assert "'reward.recipes'" in err and f"{tmp_path / 'train.jsonl'}:1:" in err, err
    assert "label 'arithmetic', which is not a recipe; recipes: ['gsm8k']" in err and "rename the recipe" in err, err


def test_overlong_prompts_are_counted_with_the_longest_and_the_length_that_fits(tmp_path, assets, tiny_task_overrides, capsys):
    """Issue 44 item 14: not only the first overlong row, but how many, the longest and what fits."""
    overrides = _own(tmp_path, assets, tiny_task_overrides)
    train = tmp_path / "train.jsonl"

    def longest() -> int:  # what `tidal check` reports of the training data
        assert cli.main(["check", "quickstart", *overrides]) == 0
        return int(capsys.readouterr().out.split(f"data: {train}: ")[1].split("longest prompt ")[1].split()[0])

    usual = longest()
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    rows[5]["prompt"] += " and then add 1 + 2 + 3 + 4"  # the longest, and two more over the usual length
    rows[9]["prompt"] += " and 1"
    rows[20]["prompt"] += " and 1"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    most = longest()
    err = _check_error(capsys, overrides + [f"data.max_prompt_len={usual}"])
    assert "'data.max_prompt_len'" in err and f"{train}: 3 of the {len(rows)} rows checked have a prompt longer than " \
        f"data.max_prompt_len={usual} tokens; the longest, {train}:6, has {most}: set data.max_prompt_len={most} to fit them" in err, err
    assert cli.main(["check", "quickstart", *overrides, f"data.max_prompt_len={most}"]) == 0  # the value named fits


def test_max_new_tokens_beyond_the_model_is_named_before_the_micro_batches(tmp_path, assets, tiny_task_overrides, capsys):
    overrides = _own(tmp_path, assets, tiny_task_overrides, "rollout.max_new_tokens=500", "train.micro_batch_tokens=256")
    err = _check_error(capsys, overrides)
    assert "'rollout.max_new_tokens'" in err and "exceeds the model's 128 positions" in err, err
    err = _check_error(capsys, _own(tmp_path / "b", assets, tiny_task_overrides, "train.micro_batch_tokens=32"))
    assert "'train.micro_batch_tokens'" in err and "must hold the longest sequence" in err, err


def test_env_max_total_tokens_beyond_the_model(tmp_path, assets, tiny_task_overrides, capsys):
    err = _check_error(capsys, _own(tmp_path, assets, tiny_task_overrides, "env.max_total_tokens=1000"))
    assert "'env.max_total_tokens'" in err and "exceeds the model's 128 positions" in err and "<= 64" in err, err


def test_a_rule_that_cannot_read_the_reference(tmp_path, assets, tiny_task_overrides, capsys):
    overrides = _own(tmp_path, assets, tiny_task_overrides, "reward.components.correct={type: math_answer}")
    assert cli.main(["check", "quickstart", *overrides]) == 0  # "92" is an answer math_answer reads
    assert "data: " in capsys.readouterr().out
    _rewrite_row(tmp_path / "train.jsonl", 3, lambda row: {**row, "reference": None})
    err = _check_error(capsys, overrides)
    assert "'reward.components.correct'" in err and f"{tmp_path / 'train.jsonl'}:3: math_answer reads no answer from the reference None" in err, err
