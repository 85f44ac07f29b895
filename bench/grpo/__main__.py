"""``python -m bench.grpo e2e ...`` (Tidal against TRL), ``python -m bench.grpo matrix ...`` (the
workload matrix); ``worker`` is the subprocess entry the two use."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    usage = "usage: python -m bench.grpo {e2e,matrix} [--help | options]"
    if not argv or argv[0] not in ("e2e", "matrix", "worker"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "worker":
        from bench.grpo.procs import run_worker

        return run_worker(*argv[1:3])
    if argv[0] == "e2e":
        from bench.grpo.e2e import main as run
    else:
        from bench.grpo.matrix import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
