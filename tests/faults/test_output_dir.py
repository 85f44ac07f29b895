"""Odd ``run.output_dir`` values (issue 51 item 7): ``tidal check`` passed ``/``, ``/dev/null`` and
``/proc/self``; a run into a home folder holding ``.ssh/`` ended 0 with no warning; ``~/x`` made a
literal ``./~`` folder while the console printed ``~/...``. Each is one config error line at
``run.output_dir`` from ``tidal check`` and ``tidal train`` (exit 2, nothing written), and ``~`` is
the home folder, as in ``task.workdir`` and ``tidal export --out``."""

import os
from pathlib import Path

import pytest

from tidal import cli
from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.run.run_dir import check_output_dir


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.mark.parametrize("value, why", [
    ("/", "is the root folder"), ("/dev/null", "is inside /dev, the kernel's files"),
    ("/proc/self", "is inside /proc, the kernel's files"), ("/sys/kernel", "is inside /sys, the kernel's files"),
    ("~", "is your home folder"), ("HOME/..", "holds your home folder"), ("SSH", "holds .ssh/, as a home folder does"),
    ("FILE", "is a file, not a folder"), ("FIFO", "is a named pipe (FIFO), not a folder"),
])
def test_no_place_for_a_run_is_refused_by_check_and_train(tmp_path, home, capsys, value, why):
    other = tmp_path / "other"
    (other / ".ssh").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    value = {"HOME/..": f"{home}/..", "SSH": str(other), "FILE": str(tmp_path / "file"), "FIFO": str(tmp_path / "fifo")}.get(value, value)
    with pytest.raises(ConfigError) as info:
        check_output_dir(os.path.expanduser(value))
    assert info.value.key == "run.output_dir" and why in info.value.message, info.value
    before = sorted(os.listdir(other))
    for command in ("check", "train"):
        assert cli.main([command, "quickstart", f"run.output_dir='{value}'", "task.workdir=/nonexistent/tasks"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tidal: config error at 'run.output_dir': ") and why in err[0], err
    assert sorted(os.listdir(other)) == before and sorted(os.listdir(home)) == [".ssh"]


def test_a_tilde_is_the_home_folder(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("quickstart", ["run.output_dir=~/runs/x"])
    assert cfg.run.output_dir == str(home / "runs" / "x")
    check_output_dir(cfg.run.output_dir)  # a folder inside the home folder is fine
    assert not Path("~").exists()
