"""``python -m bench.grpo e2e ...`` (Tidal against TRL), ``python -m bench.grpo matrix ...`` (the
workload matrix); ``worker`` is the subprocess entry the two use."""

from __future__ import annotations

import sys

from bench.grpo.procs import run_worker
from bench.grpo.setup_worker import worker_setup
from bench.grpo.tidal_runner import worker_tidal
from bench.grpo.trl_runner import worker_trl

WORKERS = {"setup": worker_setup, "tidal": worker_tidal, "trl": worker_trl}  # what `worker NAME SPEC` runs


def main(argv: list[str]) -> int:
    usage = "usage: python -m bench.grpo {e2e,matrix} [--help | options]"
    if not argv or argv[0] not in ("e2e", "matrix", "worker"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "worker":
        return run_worker(WORKERS[argv[1]], argv[2])
    if argv[0] == "e2e":
        from bench.grpo.e2e import main as run
    else:
        from bench.grpo.matrix import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
