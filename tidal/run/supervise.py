"""The ``tidal`` command watches the process that runs it: a run never ends with exit code 0 unless
it finished.

Anything in the process that trains can end it without an exception: ``os._exit`` (or ``posix._exit``,
an ``_exit`` bound at import, ctypes' ``_exit``) in a reward function or a library, with exit code 0
and no message. No guard inside that process can stop all of them, so the command started from a
shell (``tidal train ...``, ``python -m tidal.cli ...``, each rank under torchrun) runs its work in
a child process (:func:`run_supervised`) and takes the child's exit code only when the child said,
through a pipe, that it came to the end of the command (:func:`report_outcome`, called by
:func:`tidal.cli.main` whether the command returned or raised). A child that ended without saying
so is reported in one line naming its exit code, and the command exits with that code, or 1 where it
was 0. A child ended by a signal ends the command by the same signal (torchrun reports it as such).

Signals: the child runs in its own process group, so a Ctrl-C at the terminal (or torchrun's signal
to its worker's group) reaches this process alone, which passes SIGINT, SIGTERM and SIGHUP on to
the child once: Tidal's graceful stop counts signals, and a second one aborts at once. One signal
may come several ways at once: Slurm signals every process of a job step (the agent, this process
and the child), and the agent passes its own on to this process. So this process passes a signal on
at most once per :data:`REPEAT_S`, and says so to the child through a pipe before it signals it
(:func:`forwarded`): the child counts a copy passed on within :data:`REPEAT_S` of another signal as
that signal (:class:`tidal.run.stop.StopRequest`). The child dies with this process
(``PR_SET_PDEATHSIG``) if this one is killed.

Under torchrun (a torch elastic agent started this process: ``TORCHELASTIC_RUN_ID`` is set) the
agent is this process's parent, and a rank is useless without it: the agent is what stops, restarts
or reports the node's ranks. When the agent is gone (killed alone, its node's other processes alive)
this process says so in one line and kills the child's process group, so the other nodes' ranks find
this node's ranks gone (their collectives fail, their heartbeats stop: the watchdog reports the lost
node, exit code 3) instead of training beside orphans, and the command exits with
:data:`AGENT_LOST_EXIT_CODE`.

Job control follows the terminal: a Ctrl-Z (SIGTSTP) stops the child's process group, then this
process (the shell sees a stopped job), and the SIGCONT of ``fg``/``bg`` resumes this process, which
resumes the child's group.

What the child leaves behind: a process that a reward function, an environment or a library started
and never stopped (a sandbox, a server) stays in the child's process group and, holding the
command's stdout, keeps ``tidal train ... | cat`` open long after the run. When the child has
ended, this process ends what is left of its group (SIGTERM, then SIGKILL after
:data:`LEFTOVER_GRACE_S`) and names it in one line. A process that left the group on purpose
(``setsid``, ``start_new_session``) is its starter's to stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OUTCOME_FD_ENV = "TIDAL_OUTCOME_FD"  # set in the child: the pipe it reports its exit code into
FORWARD_FD_ENV = "TIDAL_FORWARD_FD"  # set in the child: the pipe that says a signal was passed on
REPEAT_S = 2.0  # copies of one signal arrive within this (a scheduler's, the agent's, this process's)
SUPERVISED_COMMANDS = ("train", "check", "eval", "export")
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
AGENT_LOST_EXIT_CODE = 3  # the watchdog's code (tidal.run.watchdog.EXIT_CODE): this rank's part of the job is lost
AGENT_POLL_S = 0.5  # how often the supervisor looks whether its torchrun agent is still its parent
LEFTOVER_GRACE_S = 3.0  # what a process the run left behind gets between SIGTERM and SIGKILL


def wanted(argv: list[str]) -> bool:
    """Whether ``tidal ARGV`` as a program runs its work in a supervised child (not in the child itself)."""
    return bool(argv) and argv[0] in SUPERVISED_COMMANDS and OUTCOME_FD_ENV not in os.environ


_outcome_fd: int | None = None  # in a supervised child: the pipe's write end (set once, by start_child)
_forward_fd: int | None = None  # in a supervised child: the read end of the supervisor's signal notes


def start_child() -> None:
    """In a supervised child (a no-op elsewhere): take the pipe from the environment (no process
    this one starts inherits it), and be killed when the supervisor dies (Linux)."""
    global _outcome_fd, _forward_fd
    fd = os.environ.pop(OUTCOME_FD_ENV, None)
    forward = os.environ.pop(FORWARD_FD_ENV, None)
    if fd is None:
        return
    _outcome_fd = int(fd)
    os.set_inheritable(_outcome_fd, False)
    if forward is not None:
        _forward_fd = int(forward)
        os.set_inheritable(_forward_fd, False)
        os.set_blocking(_forward_fd, False)
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() == 1:  # the supervisor died before the call
            os._exit(1)


def forwarded() -> bool:
    """In a supervised child, in a signal handler: whether the supervisor passed a signal on since
    the last call (it writes to the pipe before it signals); False elsewhere."""
    if _forward_fd is None:
        return False
    try:
        return bool(os.read(_forward_fd, 64))
    except (BlockingIOError, OSError):
        return False


def report_outcome(code: int | None) -> None:
    """In a supervised child: say that the command came to its end (``code``: its exit code, None
    when it raised); a no-op elsewhere, and after the first call."""
    global _outcome_fd
    fd, _outcome_fd = _outcome_fd, None
    if fd is None:
        return
    try:
        os.write(fd, f"{'raised' if code is None else code}\n".encode())
        os.close(fd)
    except OSError:  # the supervisor is gone: nobody to tell
        pass


def run_supervised(argv: list[str]) -> int:
    """Run ``tidal ARGV`` as a supervised child; its exit code, checked (module docstring)."""
    read_fd, write_fd = os.pipe()
    note_r, note_w = os.pipe()
    env = dict(os.environ, **{OUTCOME_FD_ENV: str(write_fd), FORWARD_FD_ENV: str(note_r)})
    child = subprocess.Popen([sys.executable, "-c", _child_code(), *argv], env=env, pass_fds=(write_fd, note_r),
                             process_group=0)
    os.close(write_fd)
    os.close(note_r)
    os.set_blocking(note_w, False)
    last: dict[int, float] = {}

    def forward(signum, _frame):
        now = time.monotonic()
        if now - last.get(signum, -REPEAT_S) < REPEAT_S:
            return  # a copy of the signal just passed on (module docstring)
        last[signum] = now
        try:
            os.write(note_w, b"f")
        except OSError:  # the child is gone, or its notes are unread: it learns no more from them
            pass
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    previous |= _follow_job_control(child.pid)
    try:
        code = _wait(child, argv[0], agent=os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(note_w)
        _end_leftovers(argv[0], child.pid)
    if code is None:
        os.close(read_fd)
        return AGENT_LOST_EXIT_CODE
    os.set_blocking(read_fd, False)  # a process the child forked may hold the pipe open: read what is there
    try:
        said = os.read(read_fd, 64).decode(errors="replace").strip()
    except BlockingIOError:
        said = ""
    finally:
        os.close(read_fd)
    return _outcome(argv[0], child.pid, code, said)


def _wait(child: subprocess.Popen, command: str, *, agent: int | None) -> int | None:
    """The child's exit code; with ``agent`` (the torchrun agent's pid, this process's parent), None
    once the agent is gone (this process was re-parented), after killing the child's process group."""
    if agent is None:
        return child.wait()
    while True:
        try:
            return child.wait(timeout=AGENT_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != agent:
            break
    print(f"tidal: {_who()}: the torchrun agent that started this rank (pid {agent}) is gone; ending the rank's "
          f"{command} process (pid {child.pid}), so that the other nodes stop and "
          "report this node lost instead of training beside it", file=sys.stderr, flush=True)
    try:
        os.killpg(child.pid, signal.SIGKILL)  # the child and what it started (reward workers) in its group
    except ProcessLookupError:
        pass
    child.wait()
    return None


def _who() -> str:
    """``rank R (node G, host H)`` from torchrun's environment."""
    import socket

    return f"rank {os.environ.get('RANK', '?')} (node {os.environ.get('GROUP_RANK', '?')}, host {socket.gethostname()})"


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command name) of the live processes of process group ``pgid`` (Linux's /proc; elsewhere
    one unnamed entry while the group exists)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [(pgid, "?")]
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        name, _, rest = stat.partition(" (")[2].rpartition(") ")
        state, _ppid, group = rest.split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            members.append((int(entry), name))
    return members


def _end_leftovers(command: str, pgid: int) -> None:
    """End the processes still in the ended child's process group ``pgid`` (module docstring)."""
    left = _group_members(pgid)
    if not left:
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _group_members(pgid):
            break
    shown = ", ".join(f"{pid} ({name})" for pid, name in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
    print(f"tidal: ended {len(left)} process(es) the {command} left running: pid {shown}; something the run started "
          "(a reward function's subprocess, a sandbox, a server) did not stop it", file=sys.stderr, flush=True)


def _follow_job_control(child_pid: int) -> dict:
    """Handlers that make a stop of this process a stop of the child's process group (the child and
    what it started there) and a continue a continue of it; the handlers they replace."""

    def to_child(signum: int) -> None:
        try:
            os.killpg(child_pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(_signum, _frame):
        to_child(signal.SIGSTOP)  # SIGTSTP may be caught or ignored; a paused run must pause
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stop here, as the shell expects; SIGCONT goes on below
        signal.signal(signal.SIGTSTP, stop)
        to_child(signal.SIGCONT)

    def resume(_signum, _frame):  # a SIGCONT that found this process running (``kill -CONT``, ``bg`` after SIGSTOP)
        to_child(signal.SIGCONT)

    return {signal.SIGTSTP: signal.signal(signal.SIGTSTP, stop), signal.SIGCONT: signal.signal(signal.SIGCONT, resume)}


def _child_code() -> str:
    """The child's program: this process's ``tidal`` package (not one a different working directory
    would put first on the path) and ``argv[0]`` (the run lock records the command line)."""
    import tidal

    root = os.path.dirname(os.path.dirname(os.path.abspath(tidal.__file__)))
    return (f"import sys; sys.argv[0] = {sys.argv[0]!r}; sys.path.insert(0, {root!r}); "
            "from tidal.cli import main; sys.exit(main())")


def _outcome(command: str, pid: int, code: int, said: str) -> int:
    if code < 0:  # ended by a signal: end the same way, so whoever started the command sees it
        if not said and -code not in _FORWARDED:  # a SIGINT/SIGTERM came through us: the user knows of it
            print(f"tidal: the {command} process (pid {pid}) was ended by signal {signal.Signals(-code).name} before the "
                  "command finished", file=sys.stderr, flush=True)
        if -code != signal.SIGKILL:  # SIGKILL's handler cannot be set (nor caught)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    if said:
        return code
    print(f"tidal: the {command} process (pid {pid}) ended with exit code {code} before the command finished, without an "
          "error of its own: something it ran ended the process (a reward function or a library calling _exit?). The "
          f"{command} did not finish{'; rerun the same command to resume from its last checkpoint' if command == 'train' else ''}",
          file=sys.stderr, flush=True)
    return code or 1
