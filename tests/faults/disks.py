"""A real disk that fills up, for the full-disk fault tests."""

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (skips the test where mounting needs root)."""
    path.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
