"""Runs inside the sandbox process (standard library only): enter the network isolation, set the
resource limits, then run the code read from stdin as ``__main__``.

argv[1]: JSON ``{"cpu_seconds", "memory_bytes", "file_bytes", "isolate_network"}``. When the
isolation cannot be entered it writes a line starting with ``TIDAL_SANDBOX_ERROR`` to stderr and
exits with status 97, before running anything.
"""

import ctypes
import json
import os
import resource
import sys

SETUP_FAILED = 97
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def _fail(what: str) -> None:
    sys.stderr.write(f"TIDAL_SANDBOX_ERROR {what}\n")
    sys.stderr.flush()
    os._exit(SETUP_FAILED)


def _isolate_network() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)
    except (OSError, AttributeError) as e:
        _fail(f"unshare unavailable: {e}")
    if rc != 0:
        _fail(f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")


def _limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # Tidal's modules are not the code's
    cfg = json.loads(sys.argv[1])
    code = sys.stdin.read()
    if cfg["isolate_network"]:
        _isolate_network()
    cpu = int(cfg["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL 1 s later
    _limit(resource.RLIMIT_AS, int(cfg["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(cfg["file_bytes"]))
    _limit(resource.RLIMIT_CORE, 0)
    sys.argv = ["<tool>"]
    sys.stdin = open(os.devnull)
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException:  # the code's own error: its traceback without this file's frame
        import traceback

        etype, exc, tb = sys.exc_info()
        traceback.print_exception(etype, exc, tb.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
