"""A node's parts lost (issue 48 items 1-2), without a training run: the supervising ``tidal``
command of a rank whose torchrun agent is gone ends the rank. The runs on simulated nodes are in
tests/integration/test_multinode.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The "agent": starts a supervisor (as torchrun starts `python -m tidal.cli train ...`) and sleeps.
# The supervisor waits (tidal.run.supervise._wait) on a "rank" in its own process group, which
# starts a "reward worker" of its own; each writes its pid.
AGENT = """
import subprocess, sys, time
sup = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stderr=open(sys.argv[2] + "/supervisor.err", "w"))
open(sys.argv[2] + "/supervisor.pid", "w").write(str(sup.pid))
time.sleep(600)
"""
SUPERVISOR = """
import os, subprocess, sys
from tidal.run import supervise
rank = ("import subprocess, sys, time, os; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "open(sys.argv[1] + '/worker.pid', 'w').write(str(w.pid)); time.sleep(600)")
child = subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]], process_group=0)
sys.exit(3 if supervise._wait(child, "train", agent=os.getppid()) is None else 0)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(path: Path, deadline: float) -> int:
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def test_a_rank_whose_agent_is_gone_is_ended_with_what_it_started(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="2", GROUP_RANK="1")
    agent = subprocess.Popen([sys.executable, "-c", AGENT, SUPERVISOR, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        supervisor = _read_pid(tmp_path / "supervisor.pid", deadline)
        worker = _read_pid(tmp_path / "worker.pid", deadline)
        time.sleep(2 * 0.5)  # the supervisor polls its parent every AGENT_POLL_S: nothing happens while it lives
        assert _alive(supervisor) and _alive(worker)
        agent.kill()
        agent.wait()
        killed = time.monotonic()
        while _alive(supervisor) or _alive(worker):
            assert time.monotonic() - killed < 10, "the rank outlived its agent"
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            agent.kill()
    err = (tmp_path / "supervisor.err").read_text()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"tidal: rank 2 (node 1, host {os.uname().nodename}): the torchrun agent that started this rank (pid {agent.pid}) "
        "is gone; ending the rank's train process"), err


def test_without_torchrun_the_supervisor_does_not_watch_its_parent(monkeypatch):
    """A `tidal train` from a shell keeps running when that shell goes (nohup, a terminal closed
    under tmux): only a torch elastic agent's worker (TORCHELASTIC_RUN_ID) watches its parent."""
    from tidal.run import supervise

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert supervise._wait(child, "train", agent=None) == 7
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(5)"])
    assert supervise._wait(child, "train", agent=os.getppid()) == 5  # the agent alive: the child's own code
    assert supervise.AGENT_LOST_EXIT_CODE == __import__("tidal.run.watchdog", fromlist=["EXIT_CODE"]).EXIT_CODE


def test_a_signal_passed_on_by_the_supervisor_within_the_window_is_the_same_signal(monkeypatch):
    """Slurm signals every process of a job step: a rank's child gets SIGTERM itself and again from
    its supervising command (which notes it in the pipe first). The copy is the same signal; two
    signals sent to the process itself still count as two, and so does a copy past the window."""
    from tidal.run import stop, supervise

    with stop.StopRequest() as req:
        os.kill(os.getpid(), signal.SIGINT)
        assert req.signum == signal.SIGINT
        monkeypatch.setattr(supervise, "forwarded", lambda: True)
        os.kill(os.getpid(), signal.SIGINT)  # the supervisor's copy: no KeyboardInterrupt
        monkeypatch.setattr(supervise, "forwarded", lambda: False)
        req._last = (time.monotonic() - 2 * supervise.REPEAT_S, True)  # long after: a second signal
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            raise AssertionError("a second signal past the window did not abort")
        except KeyboardInterrupt:
            pass
    with stop.StopRequest() as req:
        os.kill(os.getpid(), signal.SIGINT)
        try:
            os.kill(os.getpid(), signal.SIGINT)  # sent to the process itself twice: a second signal
            time.sleep(0.1)
            raise AssertionError("a second direct signal did not abort")
        except KeyboardInterrupt:
            pass


def test_the_supervisors_signal_note_is_read_once(tmp_path):
    """forwarded() reads what the supervisor wrote before signalling, once; nothing: False."""
    from tidal.run import supervise

    r, w = os.pipe()
    os.set_blocking(r, False)
    old, supervise._forward_fd = supervise._forward_fd, r
    try:
        assert not supervise.forwarded()
        os.write(w, b"f")
        assert supervise.forwarded() and not supervise.forwarded()
    finally:
        supervise._forward_fd = old
        os.close(r)
        os.close(w)
