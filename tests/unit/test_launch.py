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


def test_a_rendezvous_without_the_nodes_asked_for_is_one_line_and_exit_3(monkeypatch, capsys):
    """Issue 48 item 3: a rendezvous that times out (a lost node that never came back) ends the
    launcher with one line naming the wait and what to do, exit 3 (as a lost node), not a traceback."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    def run(args):
        raise RendezvousTimeoutError("The node failed to join the rendezvous in time")

    monkeypatch.setattr("torch.distributed.run.run", run)
    argv = ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node-0:29500",
            "--rdzv-id", "grpo-1", "--rdzv-conf", "join_timeout=120,last_call_timeout=5", "train", "quickstart"]
    assert launch.main(argv) == 3
    err = capsys.readouterr().err
    assert err == ("tidal launch: the rendezvous node-0:29500 (--rdzv-id grpo-1) timed out after join_timeout=120 s "
                   "(--rdzv-conf join_timeout=S) without the 2 node(s) --nnodes 2 asks for: a node was lost or never "
                   "started. The job ends here; its newest checkpoint stays in run.output_dir: rerun the same command on "
                   "the nodes you have to resume (checkpoint.resume: auto; an --nnodes MIN:MAX range goes on without a "
                   "lost node)\n")


@pytest.mark.parametrize("nnodes,conf,wants", [
    ("2", "", "for the 2 nodes --nnodes 2 asks for (a lost node must come back, e.g. restarted by the scheduler; "
              "--nnodes 1:N goes on with the nodes left) at the rendezvous h:1 (--rdzv-id r), up to join_timeout=600 s"),
    ("1:2", "join_timeout=30", "for 1 to 2 nodes (--nnodes 1:2: the job goes on with the nodes that come) at the "
                               "rendezvous h:1 (--rdzv-id r), up to join_timeout=30 s"),
])
def test_a_restart_says_what_it_waits_for(nnodes, conf, wants):
    args, _ = launch.parse_launch_args(["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1",
                                        "--rdzv-id", "r", "--rdzv-conf", conf, "--max-restarts", "2", "train", "quickstart"])
    assert launch.waiting_line(args, 1) == ("tidal launch: restarting the ranks (restart 1 of --max-restarts 2), resuming "
                                            f"from the newest checkpoint: waiting {wants} (--rdzv-conf join_timeout=S)")


def test_the_agent_says_the_wait_before_a_restart_after_a_failure_only(monkeypatch, capsys):
    """The wrapped agent method prints the line for a failed group (not for a node joining), and a
    second launch in one process wraps torch's method again, not the first wrapper."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState

    calls = []
    monkeypatch.setattr(SimpleElasticAgent, "_restart_workers", lambda agent, group: calls.append(group.state))
    for _ in range(2):
        args, _ = launch.parse_launch_args(["--nnodes", "2", "--max-restarts", "1", "train", "quickstart"])
        launch._announce_restarts(args)
    agent = SimpleNamespace(_remaining_restarts=0)
    spec = SimpleNamespace(max_restarts=1)
    SimpleElasticAgent._restart_workers(agent, SimpleNamespace(state=WorkerState.FAILED, spec=spec))
    SimpleElasticAgent._restart_workers(agent, SimpleNamespace(state=WorkerState.HEALTHY, spec=spec))
    assert calls == [WorkerState.FAILED, WorkerState.HEALTHY]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tidal launch: restarting the ranks (restart 1 of --max-restarts 1)")
