"""Run a test script under ``torchrun`` on CPU and read what each rank wrote.

The script gets ``TIDAL_TEST_OUT`` (a folder) and writes ``rank{r}.json`` there; ``env`` adds
variables (``OMP_NUM_THREADS=1`` is set: the ranks share the machine's cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def run_ranks(script: Path, out: Path, *, nproc: int = 2, timeout: int = 600, **env: str) -> list[dict]:
    """The ranks' JSON results, in rank order; the run must exit 0 (else its output tails are shown)."""
    env = dict(os.environ, TIDAL_TEST_OUT=str(out), OMP_NUM_THREADS="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
