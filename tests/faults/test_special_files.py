"""Special files where Tidal expects plain ones (issue 51 item 3): a named pipe, ``/dev/zero``, a
symlink to ``/dev/full``, a directory, a symlink loop as a config file, a data file or a run's
``metrics.jsonl``. Each was a hang (a pipe waits for a writer forever), a read until the kernel
killed the trainer, a raw ``IsADirectoryError`` or "does not exist"; each is one line naming the
path and what it is, with exit 2 before any model loads, and the file is left as it was."""

import os
import socket

import pytest

from tidal import cli
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.files import check_regular, not_regular, open_regular, read_bounded
from tidal.logging import MetricsLogger
from tidal.logging.config import LoggingConfig

pytestmark = pytest.mark.timeout(120)  # before the fix a pipe blocked these tests forever


@pytest.fixture(autouse=True)
def _teardown_process_group():
    yield
    shutdown()


def _special(tmp_path, kind: str, name: str):
    """``tmp_path/name`` made into a special file of ``kind``."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_full":
        os.symlink("/dev/full", path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        os.symlink(path.name, path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    return path


WORDS = {"fifo": "is a named pipe (FIFO)", "dev_full": "is a symlink to /dev/full, a character device",
         "dev_zero": "is a symlink to /dev/zero, a character device", "directory": "is a directory",
         "loop": "is a symlink loop", "socket": "is a socket"}


@pytest.mark.parametrize("kind", sorted(WORDS))
def test_what_a_path_is_said_before_it_is_opened(tmp_path, kind):
    path = _special(tmp_path, kind, "f")
    for call in (lambda: check_regular(path), lambda: open_regular(path), lambda: read_bounded(path, 10),
                 lambda: open_regular(path, "a")):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value).startswith(f"{path} {WORDS[kind]}") and "not a regular file" in str(info.value)
    assert not_regular(tmp_path) == "a directory"


def test_a_regular_file_and_a_symlink_to_one_are_read(tmp_path):
    (tmp_path / "a").write_text("x\n")
    os.symlink("a", tmp_path / "b")
    assert read_bounded(tmp_path / "b", 2) == b"x\n" and not_regular(tmp_path / "b") is None
    with pytest.raises(ValueError, match=r"holds 2 bytes, more than the 1 a file may hold"):
        read_bounded(tmp_path / "a", 1)
    with open_regular(tmp_path / "new", "a", encoding="utf-8") as f:  # an append creates a missing file
        f.write("y")
    assert (tmp_path / "new").read_text() == "y"
    os.symlink("nowhere", tmp_path / "dangling")
    with pytest.raises(ValueError, match=r"dangling is a symlink to nowhere, which does not exist$"):
        check_regular(tmp_path / "dangling")
    with pytest.raises(FileNotFoundError):
        check_regular(tmp_path / "missing")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "loop"])
def test_a_config_file_that_is_no_regular_file(tmp_path, capsys, kind):
    path = _special(tmp_path, kind, "run.yaml")
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tidal: config error at '<config>': {path} {WORDS[kind]}, not a regular config file" or (
        kind == "loop" and err.startswith(f"tidal: config error at '<config>': {path} is a symlink loop")), err


@pytest.fixture(scope="module")
def assets(tiny_task_overrides):
    from tidal.tasks import prepare

    return prepare(load_config("quickstart", tiny_task_overrides).task)


def _own_data(assets, tiny_task_overrides, train: str, tmp_path) -> list[str]:
    return [o for o in tiny_task_overrides if not o.startswith("task.")] + [
        "task.name=", f"model.path={assets.model_path}", f"data.train=[{{path: {train}, format: jsonl}}]",
        f"run.output_dir={tmp_path / 'run'}"]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "loop"])
def test_a_data_file_that_is_no_regular_file(tmp_path, assets, tiny_task_overrides, capsys, kind):
    """A FIFO made ``tidal check`` hang with no message; a symlink loop was "does not exist"."""
    path = _special(tmp_path, kind, "train.jsonl")
    assert cli.main(["check", "quickstart", *_own_data(assets, tiny_task_overrides, str(path), tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"tidal: config error at 'data.train[0].path': {path} {WORDS[kind]}"), err


@pytest.mark.parametrize("kind", ["fifo", "dev_full", "directory"])
def test_a_metrics_file_that_is_no_regular_file(tmp_path, tiny_task_overrides, capsys, kind):
    """``metrics.jsonl`` as a FIFO hung a resume forever; as a symlink to /dev/full it was read into
    memory until the kernel killed the trainer (24 GB); as a folder it was a raw IsADirectoryError.
    The run is refused when it claims its directory, before anything loads, and nothing there changes."""
    run = tmp_path / "run"
    run.mkdir()
    path = _special(run, kind, "metrics.jsonl")
    before = sorted(os.listdir(run))
    assert cli.main(["train", "quickstart", *tiny_task_overrides, f"run.output_dir={run}"]) == 2
    text = capsys.readouterr().err
    err = text.strip().splitlines()[-1]
    assert err == (f"tidal: config error at 'run.output_dir': {path} {WORDS[kind]}, not a regular file: the run writes "
                   "its metrics.jsonl there; move it away, or choose another run.output_dir"), err
    assert "Loading weights" not in text and sorted(os.listdir(run)) == before
    with pytest.raises(ValueError, match=WORDS[kind].replace("(", r"\(").replace(")", r"\)")):  # the logger itself, as on a rewind
        MetricsLogger(LoggingConfig(backends=["jsonl"]), run, is_main=True, total_steps=4, start_step=2)
