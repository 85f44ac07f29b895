"""`tidal launch` (issue 23 item 3): torchrun's options parsed by torchrun's parser, the exit code of
the first failed rank kept (a config error exits 2, not 1), torch's failure report only for crashes;
the elastic error file that names a config error in plain torchrun's report. The real 2-process runs
are in tests/integration/test_launch_torchrun.py."""

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tidal import launch
from tidal.cli import main


def test_torchrun_options_then_the_tidal_command():
    args, argv = launch.parse_launch_args(["--standalone", "--nproc_per_node", "2", "train", "quickstart", "run.steps=3"])
    assert argv == ["train", "quickstart", "run.steps=3"]
    assert (args.standalone, args.nproc_per_node, args.module) == (True, "2", True)
    assert (args.training_script, args.training_script_args) == ("tidal.cli", argv)


@pytest.mark.parametrize("argv,said", [
    (["--nproc_per_node", "2", "quickstart"], "expected a Tidal command (train, check, eval, export)"),
    (["--nproc_per_node", "2", "-m", "train", "quickstart"], "--module, --no-python and --run-path are set by tidal launch"),
])
def test_a_wrong_launch_line_says_what_is_expected(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        launch.parse_launch_args(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def failure(tmp_path, rank: int, exitcode: int, message: str | None = None) -> ProcessFailure:
    path = tmp_path / f"error_{rank}.json"
    if message is not None:
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(rank)}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


@pytest.mark.parametrize("codes,expected,report", [
    ((2, 2), 2, False),  # config error: rank 0 said it; nothing more
    ((75, -15), 75, False),  # graceful stop
    ((1, -15), 1, True),  # a crash: torch's report, exit 1
    ((-9, -15), 128 + signal.SIGKILL, True),  # killed: 128 + N like a shell
])
def test_the_first_failed_rank_sets_the_exit_code(codes, expected, report, tmp_path, monkeypatch, capsys):
    failures = {r: failure(tmp_path, r, c, f"boom {r}") for r, c in enumerate(codes)}

    def run(args):
        raise ChildFailedError("tidal.cli", failures)

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert launch.main(["--nproc_per_node", "2", "train", "quickstart"]) == expected
    err = capsys.readouterr().err
    assert ("Root Cause (first observed failure)" in err and "boom 0" in err) == report
    if not report:
        assert err == ""


def test_a_config_error_is_written_to_the_elastic_error_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    assert main(["check", "quickstart", "run.steps=-1"]) == 2
    assert capsys.readouterr().err == ""  # rank 1 is quiet; its error file names the error for torchrun's report
    message = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(path)).message  # as torchrun reads it
    assert message["message"] == "tidal: config error at 'run.steps': must be >= 1"
    assert message["extraInfo"]["py_callstack"] == message["message"]


def test_a_signal_to_the_launcher_ends_it_like_a_shell(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing import SignalException

    def run(args):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert launch.main(["--nproc_per_node", "2", "train", "quickstart"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert err.startswith("tidal launch: stopped by SIGTERM") and err.count("\n") == 1
