"""``tidal launch``: torchrun that keeps Tidal's exit codes and its one-line config errors.

    tidal launch [torchrun options] {train,check,eval,export} CONFIG [overrides]

is ``torchrun [torchrun options] -m tidal.cli COMMAND CONFIG [overrides]`` (every torchrun option,
torch's own launcher, :func:`torch.distributed.run.run`), with one difference: torchrun ends with exit
code 1 and a ``ChildFailedError`` report of about 40 lines whenever a rank fails, whatever the rank's
exit code. Here the launcher ends with the exit code of the first rank that failed, so a config error
exits 2 and a rank's graceful stop 75 as documented (``tidal train --help``); a signal to the
launcher itself (passed on to the ranks by torch's agent) ends it with 128 + the signal's number. For the codes Tidal documents,
whose one-line message a rank has already printed (rank 0 prints a config error), nothing else is
printed; for any other failure (a crash) torch's failure report is printed as torchrun prints it.

Several nodes: one ``tidal launch`` per node with torchrun's rendezvous options (``--nnodes 2
--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID``, ``--max-restarts`` for elastic
restarts); see docs/multinode.md and tests/integration/test_multinode.py, which runs them on one machine.

Restarts (``--max-restarts``) and the rendezvous: when the agent restarts the ranks after a failure
it says in one line what it waits for (how many nodes, where, for how long: torch's
``join_timeout``, 600 s unless ``--rdzv-conf join_timeout=S``); a rendezvous that ends without the
nodes ``--nnodes`` asks for (a lost node that never came back) ends the launcher with one line and
exit code 3, as a lost node does, instead of torch's ``RendezvousTimeoutError`` traceback.

Under plain torchrun a config error also reaches torch's failure report: every rank writes it to
its elastic error file (``TORCHELASTIC_ERROR_FILE``, torch's ``errors`` support), so the report's
``traceback`` says the config error instead of pointing at the docs; torchrun still exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from tidal.run.stop import EXIT_CODE as STOP_EXIT_CODE
from tidal.run.watchdog import EXIT_CODE as WATCHDOG_EXIT_CODE

CONFIG_EXIT_CODE = 2
COMMANDS = ("train", "check", "eval", "export")
# Exit codes whose cause a rank has printed in one line (config error, graceful stop, watchdog report).
SAID_EXIT_CODES = (CONFIG_EXIT_CODE, STOP_EXIT_CODE, WATCHDOG_EXIT_CODE)
USAGE = "tidal launch [torchrun options] {train,check,eval,export} CONFIG [key.sub=value ...]"
EPILOG = ("The Tidal command and its arguments take the place of torchrun's training_script. The launcher "
          "exits with the exit code of the first rank that failed: 0 done, 2 config error, 75 stopped by "
          "SIGINT/SIGTERM/SIGHUP after a saved step, 3 a collective that a rank never entered or a node lost (also "
          "when the rendezvous ends without the nodes --nnodes asks for).")
RDZV_JOIN_TIMEOUT_S = 600  # torch's c10d rendezvous default for join_timeout


def record_error_file(message: str) -> None:
    """Write ``message`` to this rank's elastic error file when torchrun gave one (the JSON that
    torch's ``ErrorHandler.record_exception`` writes, with ``message`` as its whole traceback)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the error file is a courtesy to torchrun's report; the exit code carries the error
        pass


def parse_launch_args(argv: list[str]):
    """torchrun's options parsed by torchrun's own parser, with the Tidal command as the module's
    arguments: ``(args for torch.distributed.run.run, the tidal argv)``."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog, parser.usage, parser.epilog = "tidal launch", USAGE, EPILOG
    parser.description = "Run a Tidal command on several ranks under torch's launcher (torchrun), keeping Tidal's exit codes."
    for action in parser._actions:  # torchrun's positionals become the Tidal command in --help
        if action.dest == "training_script":
            action.metavar, action.help = "COMMAND", f"the Tidal command: {', '.join(COMMANDS)}"
        elif action.dest == "training_script_args":
            action.metavar, action.help = "ARGS", "its config and key.sub=value overrides (and --checkpoint/--out)"
    args = parser.parse_args(argv)
    if args.module or args.no_python or args.run_path:
        parser.error("--module, --no-python and --run-path are set by tidal launch itself; leave them out")
    if args.training_script not in COMMANDS:
        parser.error(f"expected a Tidal command ({', '.join(COMMANDS)}) after torchrun's options, got {args.training_script!r}")
    tidal_argv = [args.training_script, *args.training_script_args]
    args.training_script, args.training_script_args, args.module = "tidal.cli", tidal_argv, True
    return args, tidal_argv


class _QuietSaidFailures(logging.Filter):
    """Drops the agent's ``failed (exitcode: N)`` line for the exit codes whose cause a rank has said,
    and its ``Sending process P closing signal SIGTERM`` lines (the ranks still running when another
    failed; a crash's failure report lists them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        said = msg.startswith("failed (exitcode") and bool(record.args) and record.args[0] in SAID_EXIT_CODES
        return not (said or msg.startswith("Sending process"))


def exit_code(exitcode: int) -> int:
    """A rank's exit code as the launcher's (a signal N as 128 + N, like a shell)."""
    return exitcode if exitcode > 0 else 128 + (-exitcode or signal.SIGTERM)


def _nodes(args) -> tuple[int, int]:
    """``(min, max)`` nodes of ``--nnodes`` (``N`` or ``MIN:MAX``)."""
    low, _, high = str(args.nnodes).partition(":")
    return int(low), int(high or low)


def _join_timeout(args) -> float:
    """The rendezvous' join timeout in seconds: ``--rdzv-conf join_timeout=S``, else torch's default."""
    for item in (args.rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout" and value.strip():
            return float(value)
    return RDZV_JOIN_TIMEOUT_S


def waiting_line(args, restart: int) -> str:
    """What the agent waits for when it restarts the ranks after a failure (restart ``restart``)."""
    low, high = _nodes(args)
    where = f"at the rendezvous {args.rdzv_endpoint} (--rdzv-id {args.rdzv_id})" if low > 1 or high > 1 else "on this node"
    if low == high:
        wants = (f"for the {low} nodes --nnodes {args.nnodes} asks for (a lost node must come back, e.g. restarted by "
                 "the scheduler; --nnodes 1:N goes on with the nodes left)") if low > 1 else "for this node"
    else:
        wants = f"for {low} to {high} nodes (--nnodes {args.nnodes}: the job goes on with the nodes that come)"
    return (f"tidal launch: restarting the ranks (restart {restart} of --max-restarts {args.max_restarts}), resuming "
            f"from the newest checkpoint: waiting {wants} {where}, up to join_timeout={_join_timeout(args):g} s "
            "(--rdzv-conf join_timeout=S)")


def rendezvous_failed_line(args, e: BaseException) -> str:
    """One line for a rendezvous that ended without the nodes ``--nnodes`` asks for."""
    low, _ = _nodes(args)
    what = {"RendezvousTimeoutError": f"timed out after join_timeout={_join_timeout(args):g} s (--rdzv-conf join_timeout=S)",
            "RendezvousClosedError": "was closed by another node's agent (that node's job ended)"}.get(
                type(e).__name__, f"failed ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    return (f"tidal launch: the rendezvous {args.rdzv_endpoint} (--rdzv-id {args.rdzv_id}) {what} without the {low} "
            f"node(s) --nnodes {args.nnodes} asks for: a node was lost or never started. The job ends here; its newest "
            "checkpoint stays in run.output_dir: rerun the same command on the nodes you have to resume "
            "(checkpoint.resume: auto; an --nnodes MIN:MAX range goes on without a lost node)")


def _announce_restarts(args) -> None:
    """Make this process's elastic agent say :func:`waiting_line` before it restarts the ranks after
    a failure (a new node joining restarts them too: that is said by torch and needs no wait)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerState

    restart_workers = getattr(SimpleElasticAgent._restart_workers, "__wrapped__", SimpleElasticAgent._restart_workers)

    def announced(agent, worker_group):
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            spec = worker_group.spec
            print(waiting_line(args, spec.max_restarts - agent._remaining_restarts), file=sys.stderr, flush=True)
        return restart_workers(agent, worker_group)

    announced.__wrapped__ = restart_workers  # a second launch in this process wraps torch's, not this
    SimpleElasticAgent._restart_workers = announced


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import determine_local_world_size, run

    args, _ = parse_launch_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and determine_local_world_size(args.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets then, without its five-line banner
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietSaidFailures())
    _announce_restarts(args)
    try:
        run(args)
    except RendezvousError as e:
        print(rendezvous_failed_line(args, e), file=sys.stderr, flush=True)
        return WATCHDOG_EXIT_CODE
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if failure.exitcode not in SAID_EXIT_CODES:
            print(e, file=sys.stderr)
        return exit_code(failure.exitcode)
    except SignalException as e:  # the launcher itself was signalled; torch's agent passed it on to the ranks
        name = signal.Signals(e.sigval).name
        print(f"tidal launch: stopped by {name}; the ranks got it too and had --shutdown-timeout seconds "
              f"to finish their step and save it", file=sys.stderr)
        return exit_code(-int(e.sigval))
    return 0
