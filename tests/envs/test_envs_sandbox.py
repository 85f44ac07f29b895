"""The sandboxed Python tool: output, time/CPU/memory/file limits, network refusal, malformed code,
no inherited environment, and a clear refusal when the sandbox cannot be created."""

import os
import socket
import sys
import threading

import pytest

from tidal.envs import sandbox as sandbox_mod
from tidal.envs.config import SandboxConfig
from tidal.envs.sandbox import PythonSandbox, PythonTool, SandboxError
from tidal.envs.tool_calls import ToolCall
from tidal.envs.tools import ToolFailure, ToolSet

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")


def _tool(**cfg):
    return PythonTool(PythonSandbox(SandboxConfig(**cfg)))


def _run(code, timeout_s=20.0, **cfg):
    return _tool(**cfg).call({"code": code}, timeout_s=timeout_s)


def test_prints_stdout_then_the_traceback():
    out = _run("print(6 * 7)\nraise ValueError('bad')")
    lines = out.splitlines()
    assert lines[0] == "42" and lines[-1] == "ValueError: bad"
    assert "_sandbox_boot" not in out  # the launcher's frame is not shown
    assert _run("x = 1") == "(no output; use print() to show a result)"


def test_malformed_code_is_a_syntax_error_output():
    assert "SyntaxError" in _run("def f(:\n  pass")


def test_wall_clock_timeout_kills_the_process_group():
    with pytest.raises(ToolFailure, match="1 s time limit"):
        _run("import subprocess, time\nsubprocess.Popen(['sleep', '30'])\ntime.sleep(30)", timeout_s=1.0)


def test_cpu_time_limit():
    with pytest.raises(ToolFailure, match="CPU time"):
        _run("while True: pass", timeout_s=30.0, cpu_seconds=1)


def test_memory_limit_raises_memory_error_in_the_code():
    out = _run("x = bytearray(400 * 2**20)\nprint('allocated')", memory_mb=128)
    assert "MemoryError" in out and "allocated" not in out
    assert "allocated" in _run("x = bytearray(40 * 2**20)\nprint('allocated')", memory_mb=256)


def test_file_size_limit():
    # Python ignores SIGXFSZ: the write fails with EFBIG in the code, which sees its traceback.
    out = _run("open('f', 'wb').write(b'x' * (3 * 2**20))", file_mb=1)
    assert "File too large" in out
    assert _run("print(open('f', 'wb').write(b'x' * 1000))", file_mb=1) == "1000"


def test_output_is_cut():
    out = _run("print('y' * 5000)", max_output_chars=200)
    assert out.endswith("[output cut at 200 characters]") and out.count("y") == 200


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("TIDAL_TEST_SECRET", "hunter2")
    assert _run("import os\nprint(os.environ.get('TIDAL_TEST_SECRET'), os.getcwd().startswith(os.environ['HOME']))") == "None True"


@pytest.fixture
def host_server():
    """A TCP server on the host's loopback (accepts one connection)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    threading.Thread(target=lambda: srv.accept()[0].close(), daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


CONNECT = "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n    print('connected')\nexcept OSError as e:\n    print('refused', e)"


def test_network_is_refused(host_server):
    out = _run(CONNECT.format(port=host_server))
    assert out.startswith("refused"), out
    assert _run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\nexcept OSError as e:\n    print('refused')") == "refused"


def test_network_allow_is_not_isolated(host_server):
    assert _run(CONNECT.format(port=host_server), network="allow") == "connected"


def test_refuses_clearly_when_the_sandbox_cannot_be_created(tmp_path, monkeypatch):
    fake_boot = tmp_path / "boot.py"
    fake_boot.write_text("import sys\nsys.stderr.write('TIDAL_SANDBOX_ERROR unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: "
                         "Operation not permitted\\n')\nsys.exit(97)\n")
    monkeypatch.setattr(sandbox_mod, "_BOOT", fake_boot)
    monkeypatch.setattr(sandbox_mod, "_PROBED", {})
    with pytest.raises(SandboxError, match="Operation not permitted.*env.sandbox.network=allow"):
        PythonSandbox(SandboxConfig())
    with pytest.raises(SandboxError, match="not an executable"):
        PythonSandbox(SandboxConfig(python=str(tmp_path / "no-python")))


def test_toolset_turns_limits_into_failures():
    ts = ToolSet([_tool()], timeout_s=1.0, max_calls_per_turn=2)
    ok, slow = ts.run([ToolCall("python", {"code": "print(1)"}), ToolCall("python", {"code": "import time; time.sleep(20)"})])
    assert ok.status == "ok" and ok.content == "1"
    assert slow.status == "failure" and "time limit" in slow.content


def test_sandboxes_run_concurrently_from_threads():
    tool = _tool()
    outs = [None] * 4

    def work(i):
        outs[i] = tool.call({"code": f"print({i} * 2)"}, timeout_s=20)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs == ["0", "2", "4", "6"]


def test_working_directory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_mod.tempfile, "tempdir", str(tmp_path))
    assert _run("open('scratch', 'w').write('x')\nprint('ok')") == "ok"
    assert os.listdir(tmp_path) == []
