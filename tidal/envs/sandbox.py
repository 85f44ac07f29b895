"""A sandboxed Python process per tool call, and the ``python`` tool built on it.

Isolation (Linux; see docs/agentic.md, "Sandboxed Python"):

- a fresh ``python -I`` process (no ``PYTHONPATH``, no user site) in its own session and process
  group, in an empty temporary directory (removed afterwards), with a minimal environment (no
  inherited variables, so no credentials from the trainer's environment), stdin closed;
- resource limits (``setrlimit``): CPU seconds (the kernel kills the process), address space (an
  allocation past it raises MemoryError in the code), file size (a write past it fails with
  ``OSError: File too large`` in the code: Python ignores SIGXFSZ), no core dumps;
- no network (``env.sandbox.network: isolate``): the child enters new user and network
  namespaces, where the only interface is a loopback that is down; every connection fails,
  including to the host's own loopback services;
- a wall-clock limit: at ``timeout_s`` the whole process group is killed;
- output is written to files (bounded by the file-size limit) and at most ``max_output_chars`` of
  it is read back.

It does NOT hide the file system: the code can read what the training user can read. Run
untrusted code in a container or VM around the trainer as well.

When the isolation cannot be created (unprivileged user namespaces disabled, not Linux) the
sandbox refuses to start with :class:`SandboxError` saying why and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from tidal.envs.config import SandboxConfig
from tidal.envs.tools import Tool, ToolFailure

_BOOT = Path(__file__).with_name("_sandbox_boot.py")
_SETUP_FAILED = 97
_SETUP_MARK = "TIDAL_SANDBOX_ERROR"
_PROBED: dict[tuple[str, str], str | None] = {}  # (python, network) -> error or None
_PROBE_LOCK = threading.Lock()


class SandboxError(RuntimeError):
    """The sandbox cannot be created on this machine."""


@dataclasses.dataclass(frozen=True)
class SandboxRun:
    """The outcome of one run. ``limit`` names the limit that killed the process (``wall-clock``,
    ``CPU time``, ``file size``), None when it exited on its own; ``returncode`` is its exit status
    (negative: the signal that killed it)."""

    stdout: str
    stderr: str
    returncode: int
    limit: str | None
    truncated: bool


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 4)  # UTF-8: at most 4 bytes per character
    text = data.decode("utf-8", errors="replace")
    return (text[:limit], True) if len(text) > limit or len(data) > limit * 4 else (text, False)


class PythonSandbox:
    """Runs code in a sandboxed process (see module docstring). Construction checks once per
    interpreter that the isolation works here, and raises SandboxError otherwise."""

    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.python = cfg.python or sys.executable
        if not sys.platform.startswith("linux"):
            raise SandboxError(f"the Python sandbox needs Linux (setrlimit, namespaces); this is {sys.platform}")
        if not shutil.which(self.python) and not os.access(self.python, os.X_OK):
            raise SandboxError(f"env.sandbox.python: {self.python!r} is not an executable")
        self._probe()

    def _probe(self) -> None:
        key = (self.python, self.cfg.network)
        with _PROBE_LOCK:
            if key not in _PROBED:
                run = self._run("pass", timeout_s=30.0)
                ok = run.returncode == 0
                _PROBED[key] = None if ok else (run.stderr.strip() or f"the probe exited with status {run.returncode}")
        err = _PROBED[key]
        if err is not None:
            hint = ""
            if self.cfg.network == "isolate" and _SETUP_MARK in err:
                hint = (" Unprivileged user namespaces look disabled here (sysctl kernel.unprivileged_userns_clone, "
                        "user.max_user_namespaces, or a container's seccomp profile). Enable them, or set "
                        "env.sandbox.network=allow to run WITHOUT network isolation (trusted code only).")
            raise SandboxError(f"cannot create the Python sandbox: {err.replace(_SETUP_MARK, '').strip()}.{hint}")

    def run(self, code: str, *, timeout_s: float) -> SandboxRun:
        """Run ``code`` once. A failure to enter the isolation at run time raises SandboxError."""
        run = self._run(code, timeout_s=timeout_s)
        if run.returncode == _SETUP_FAILED and _SETUP_MARK in run.stderr:
            raise SandboxError(f"the sandbox could not be entered: {run.stderr.replace(_SETUP_MARK, '').strip()}")
        return run

    def _run(self, code: str, *, timeout_s: float) -> SandboxRun:
        cfg = self.cfg
        limits = json.dumps({
            "cpu_seconds": cfg.cpu_seconds, "memory_bytes": cfg.memory_mb << 20, "file_bytes": cfg.file_mb << 20,
            "isolate_network": cfg.network == "isolate",
        })
        workdir = tempfile.mkdtemp(prefix="tidal-sandbox-")
        try:
            out_path, err_path = Path(workdir, ".stdout"), Path(workdir, ".stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [self.python, "-I", str(_BOOT), limits], stdin=subprocess.PIPE, stdout=out, stderr=err,
                    cwd=workdir, env=_child_env(workdir), start_new_session=True, close_fds=True,
                )
                limit = self._wait(proc, code, timeout_s)
            stdout, cut_out = _read_capped(out_path, cfg.max_output_chars)
            stderr, cut_err = _read_capped(err_path, cfg.max_output_chars)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        if limit is None and proc.returncode < 0:
            limit = {signal.SIGXCPU: "CPU time", signal.SIGKILL: "CPU time", signal.SIGXFSZ: "file size"}.get(
                signal.Signals(-proc.returncode) if -proc.returncode in signal.valid_signals() else None)
        return SandboxRun(stdout=stdout, stderr=stderr, returncode=proc.returncode, limit=limit, truncated=cut_out or cut_err)

    @staticmethod
    def _wait(proc: subprocess.Popen, code: str, timeout_s: float) -> str | None:
        """Feed the code, wait; kill the process group at the deadline. Returns ``wall-clock`` when
        it was killed for time, else None."""
        try:
            proc.communicate(code.encode("utf-8"), timeout=timeout_s)
            return None
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return "wall-clock"
        finally:
            try:  # children left behind by a process that exited on its own
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class PythonTool(Tool):
    """``python(code)``: run code in the sandbox; the model sees its stdout, then its stderr
    (a traceback when the code raised: MemoryError at the memory limit, OSError at the file-size
    limit), cut to ``max_output_chars``. A process killed by a limit (wall clock, CPU time, or
    SIGXFSZ in a non-Python child) is a tool failure (ToolFailure)."""

    name = "python"
    description = "Run Python 3 code and return what it prints (stdout and stderr). Use print() to see results."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python code to run"}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, sandbox: PythonSandbox):
        self.sandbox = sandbox

    @property
    def runs_own_timeout(self) -> bool:
        return True

    def call(self, arguments: dict[str, Any], *, timeout_s: float) -> str:
        run = self.sandbox.run(arguments["code"], timeout_s=timeout_s)
        if run.limit == "wall-clock":
            raise ToolFailure(f"the code ran past the {timeout_s:g} s time limit and was stopped")
        if run.limit is not None:
            raise ToolFailure(f"the code exceeded the sandbox's {run.limit} limit and was stopped")
        parts = [run.stdout.rstrip("\n")] if run.stdout.strip() else []
        if run.stderr.strip():
            parts.append(run.stderr.rstrip("\n"))
        text = "\n".join(parts) if parts else "(no output; use print() to show a result)"
        if run.truncated:
            text += f"\n[output cut at {self.sandbox.cfg.max_output_chars} characters]"
        return text
