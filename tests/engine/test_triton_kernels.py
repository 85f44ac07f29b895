"""Runs the Triton kernel checks (``triton_kernel_checks.py``) in a fresh process, so that on a
machine without CUDA Triton's interpreter is on before Triton is first imported. Skipped where
Triton is not installed."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_triton_kernels_match_torch_reference():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    checks = os.path.join(ROOT, "tests", "engine", "triton_kernel_checks.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", checks],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
