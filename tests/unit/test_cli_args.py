"""The `tidal` command line: overrides anywhere after the config, and `tidal train --help` says what
a new user needs (shipped configs, override syntax, torchrun, exit codes)."""

import pytest

from tidal.cli import build_parser, parse_args, shipped_configs
from tidal.config import load_config


def test_overrides_after_checkpoint_and_out_are_overrides():
    args = parse_args(["export", "quickstart", "--checkpoint", "ck", "--out", "hf", "run.steps=3"])
    assert (args.config, args.checkpoint, args.out, args.overrides) == ("quickstart", "ck", "hf", ["run.steps=3"])
    args = parse_args(["eval", "quickstart", "a.b=1", "--checkpoint", "ck", "c.d=2"])
    assert args.overrides == ["a.b=1", "c.d=2"]  # in the order given: a later one wins
    assert parse_args(["train", "quickstart", "x.y=1"]).overrides == ["x.y=1"]


@pytest.mark.parametrize("argv", [["eval", "quickstart", "--checkpoint", "ck", "--bogus"],
                                  ["export", "quickstart", "--checkpoint", "ck", "--out", "o", "stray"]])
def test_what_is_not_an_override_is_still_an_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_train_help_lists_configs_overrides_and_torchrun(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert shipped_configs() == ["calculator", "quickstart", "reasoning_gym", "rm_quickstart"]
    assert all(name in out for name in shipped_configs())
    assert "key.sub=value" in out and "tidal launch --nproc_per_node" in out and "2 config error" in out
    examples = out.split("values are YAML: ")[1].split(". Every key")[0].split()
    assert len(examples) >= 4
    load_config("quickstart", examples)  # the override examples of the help are valid


@pytest.mark.parametrize("rank,said", [("0", True), ("1", False)])
def test_a_config_error_is_said_once_under_torchrun(rank, said, monkeypatch, capsys):
    from tidal.cli import main

    monkeypatch.setenv("RANK", rank)
    assert main(["check", "quickstart", "run.steps=-1"]) == 2  # exit 2 on every rank
    err = capsys.readouterr().err
    assert ("config error at 'run.steps'" in err) == said and err.count("\n") == int(said)


@pytest.mark.parametrize("rank,said", [("0", True), ("1", False)])
def test_check_passes_on_every_rank_and_rank_0_says_it(rank, said, monkeypatch, capsys):
    from tidal.cli import main

    monkeypatch.setenv("RANK", rank)
    assert main(["check", "quickstart"]) == 0
    assert ("check passed" in capsys.readouterr().out) == said
