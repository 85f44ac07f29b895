"""MCP tools (the extra ``mcp``; run by .ci/run in the extras venv): a local stdio MCP server kept
alive across episodes, its schemas rendered byte-identically, ``is_error`` results and timeouts as
counted observations, and the trained tokens exactly the sampled ones."""

import sys
import time
from pathlib import Path

import pytest

from tests.ecosystem import import_extra

import_extra("mcp", "mcp")
pytestmark = pytest.mark.extras

from tidal.config_base import ConfigError  # noqa: E402
from tidal.engine.base import SamplingParams  # noqa: E402
from tidal.envs import ChatRenderer, EnvConfig, EnvRollout, make_env_factory  # noqa: E402
from tidal.envs.adapters import mcp as adapter  # noqa: E402
from tidal.envs.tool_calls import format_tool_call  # noqa: E402

from tests.ecosystem.exact import Recorder, assert_trained_equals_sampled  # noqa: E402
from tests.envs.helpers import ScriptedEngine, chat_row  # noqa: E402

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]


def env_config(**kw) -> EnvConfig:
    settings = dict(name="mcp", kwargs={"servers": [{"command": SERVER}]}, max_turns=4, tool_timeout_s=1.0, step_timeout_s=30.0)
    return EnvConfig(**{**settings, **kw})


@pytest.fixture(scope="module", autouse=True)
def fresh_connections():
    adapter.close_all()
    yield
    adapter.close_all()


def policy(text: str, turn: int) -> str:
    """Turn 0: a right call, a call the server refuses (is_error) and the server's pid; turn 1: a
    call past the time limit; turn 2: the pid again (the connection survived the timeout); turn 3: the answer."""
    return [format_tool_call("add", {"a": 2, "b": 3}) + format_tool_call("divide", {"a": 1, "b": 0}) + format_tool_call("pid", {}),
            format_tool_call("sleep", {"seconds": 5}), format_tool_call("pid", {}), "5"][turn]


def test_stdio_server_rollout_is_exact_and_counts_errors_and_timeouts(qwen25_tok):
    tok, cfg = qwen25_tok, env_config()
    t0 = time.perf_counter()
    factory = make_env_factory(cfg)  # connects (spawns the server) once
    connect_s = time.perf_counter() - t0
    engine = ScriptedEngine(tok, policy)
    rec = Recorder(engine.generate)
    rows = [chat_row(tok, "2+3?", where="r:0"), chat_row(tok, "What is 2+3?", where="r:1")]
    t1 = time.perf_counter()
    result = EnvRollout(cfg, tok, env_factory=factory).run(rec.generate, rows, SamplingParams(max_new_tokens=400, n=2))
    assert time.perf_counter() - t1 < connect_s + 8, "the rollout's episodes spawned servers of their own"
    assert assert_trained_equals_sampled(result, rec.completions, tok.pad_token_id) == 16  # 4 trajectories x 4 turns
    for traj in result.trajectories:
        tools = [m["content"] for m in traj.messages if m["role"] == "tool"]
        assert tools[0] == "5" and "division by zero" in tools[1]  # is_error: the server's words, to the model
        assert tools[3] == "error: sleep: timed out after 1 s"
        assert tools[2] == tools[4] and tools[2].isdigit()  # one server process, alive after the timeout
        assert traj.counters == {"tool_calls": 5.0, "tool_errors": 1.0, "tool_failures": 1.0, "tool_timeouts": 1.0, "server_restarts": 0.0}
    pids = {[m["content"] for m in t.messages if m["role"] == "tool"][2] for t in result.trajectories}
    assert len(pids) == 1  # every episode, and both rows, on the same kept-alive server
    assert result.metrics["env/tool_timeouts"] == 1.0 and result.metrics["env/tool_errors"] == 1.0


def test_schemas_render_byte_identically(qwen25_tok):
    """The same tool listing, in the server's order, in every episode and after the server restarts:
    the prompt the engine is given (and the trainer trains on) is the same bytes."""
    cfg = env_config()
    renderer = ChatRenderer(qwen25_tok)
    row = chat_row(qwen25_tok, "2+3?")
    first = [make_env_factory(cfg)().reset(row) for _ in range(2)]
    adapter.close_all()  # a new server process
    again = make_env_factory(cfg)().reset(row)
    texts = {renderer.render(o.messages, tools=o.tools) for o in first + [again]}
    assert len(texts) == 1
    (text,) = texts
    assert [t["function"]["name"] for t in again.tools] == ["add", "divide", "sleep", "pid"]
    assert '"name": "add", "description": "Add two integers."' in text


def test_settings_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"env.kwargs.servers"):
        make_env_factory(env_config(kwargs={"servers": []}))
    with pytest.raises(ConfigError, match=r"env.kwargs.servers\[0\].command"):
        make_env_factory(env_config(kwargs={"servers": [{"command": SERVER, "object": "x:y"}]}))
    with pytest.raises(ConfigError, match=r"env.kwargs.tools.*no MCP tool named \['nope'\]"):
        make_env_factory(env_config(kwargs={"servers": [{"command": SERVER}], "tools": ["add", "nope"]}))
    factory = make_env_factory(env_config(kwargs={"servers": [{"command": SERVER}], "tools": ["pid", "add"]}))
    assert [t.name for t in factory().toolset.tools.values()] == ["pid", "add"]


def test_in_process_server():
    cfg = env_config(kwargs={"servers": [{"object": "tests.ecosystem.mcp_server:server"}]})
    env = make_env_factory(cfg)()
    from tidal.envs import ModelTurn

    res = env.step(ModelTurn(token_ids=[1], text=format_tool_call("add", {"a": 4, "b": 5}), finish_reason="stop", index=0))
    assert res.observation.messages[0]["content"] == "9"


@pytest.mark.parametrize("command, said", [
    ([sys.executable, "-c", "import sys; print('boom: no settings file', file=sys.stderr); sys.exit(3)"], "boom: no settings file"),
    (["/nonexistent/mcp-server"], "FileNotFoundError"),
])
def test_a_server_that_cannot_start_is_one_line_exit_2_before_any_model(command, said, capsys, tmp_path, monkeypatch):
    """Issue 47 item 5: not a traceback of the MCP SDK's task groups; the key, the reason and the
    last line the server wrote, from `tidal check` before the task's model is built."""
    import json

    from tidal.cli import main

    monkeypatch.setattr("tidal.tasks.assets._build", lambda *a, **k: pytest.fail("the task would build"))
    kwargs = json.dumps({"servers": [{"command": command, "connect_timeout_s": 20}]})
    rc = main(["check", "quickstart", "env.name=mcp", f"env.kwargs={kwargs}", "env.step_timeout_s=60", f"task.workdir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "'env.kwargs.servers[0]'" in err and "did not start" in err and said in err, err


def test_a_server_that_dies_mid_run_is_restarted_within_its_limit(qwen25_tok):
    """Killed between episodes: the next call starts it again (counted in env/server_restarts) and
    is answered; past max_restarts its calls are tool failures that say so."""
    import os
    import signal

    from tidal.envs import ModelTurn

    cfg = env_config(kwargs={"servers": [{"command": SERVER, "max_restarts": 1}]})
    env = make_env_factory(cfg)()
    env.reset(chat_row(qwen25_tok, "2+3?"))

    def call(name, args):
        res = env.step(ModelTurn(token_ids=[1], text=format_tool_call(name, args), finish_reason="stop", index=0))
        return res.observation.messages[0]["content"], res.counters

    first, _ = call("pid", {})
    os.kill(int(first), signal.SIGKILL)
    assert call("add", {"a": 2, "b": 3}) == ("5", {"tool_calls": 1.0, "tool_errors": 0.0, "tool_failures": 0.0, "tool_timeouts": 0.0,
                                                  "server_restarts": 1.0})
    second, counters = call("pid", {})
    assert second.isdigit() and second != first and counters["server_restarts"] == 0.0
    os.kill(int(second), signal.SIGKILL)
    text, counters = call("add", {"a": 1, "b": 1})
    assert "restarted 1 times, its limit" in text and counters["tool_failures"] == 1.0 and counters["server_restarts"] == 0.0


def test_server_logging_goes_to_its_log_file_not_the_console(capfd, tmp_path):
    """A stdio server's stderr and an in-process MCPServer's logging (it configures the root logger
    at INFO with a console handler on import) go to RUN_DIR/env_logs, not the console."""
    import logging

    from tidal.envs import ModelTurn

    adapter.close_all()
    adapter.McpEnv.log_to(str(tmp_path))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    for server in ({"command": SERVER}, {"object": "tests.ecosystem.mcp_server:server"}):
        env = make_env_factory(env_config(kwargs={"servers": [server]}))()
        env.step(ModelTurn(token_ids=[1], text=format_tool_call("pid", {}), finish_reason="stop", index=0))
    assert root.handlers == handlers and root.level == level  # the in-process server's basicConfig undone
    logging.getLogger("mcp.server.test").info("an in-process server's request")
    out = capfd.readouterr()
    assert "serving over stdio" not in out.err + out.out and "request" not in out.err + out.out, out
    logs = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert any(n.startswith("mcp-mcp_server-") and "serving over stdio" in text for n, text in logs.items()), logs
    assert any(n.startswith("mcp-tests.ecosystem.mcp_server_server-") and "an in-process server's request" in text
               for n, text in logs.items()), logs
    adapter.close_all()


def test_a_server_that_cannot_start_again_counts_each_try_against_its_limit(qwen25_tok, tmp_path):
    """Killed, and its command now fails at start: each later call tries once more (a tool failure
    saying why) until max_restarts, then says the limit; never a config error mid-run."""
    import os
    import signal

    from tidal.envs import ModelTurn

    gate = tmp_path / "refuse"
    launcher = ("import os, runpy, sys; sys.exit('refusing to start') if os.path.exists(sys.argv[1]) else None; "
                f"sys.argv = [{str(SERVER[1])!r}]; runpy.run_path({str(SERVER[1])!r}, run_name='__main__')")
    cfg = env_config(kwargs={"servers": [{"command": [sys.executable, "-c", launcher, str(gate)], "max_restarts": 2}]})
    env = make_env_factory(cfg)()
    env.reset(chat_row(qwen25_tok, "2+3?"))

    def call(name, args):
        res = env.step(ModelTurn(token_ids=[1], text=format_tool_call(name, args), finish_reason="stop", index=0))
        return res.observation.messages[0]["content"]

    pid = call("pid", {})
    gate.write_text("")
    os.kill(int(pid), signal.SIGKILL)
    said = [call("add", {"a": 1, "b": 1}) for _ in range(3)]
    assert all("did not start again" in s and "refusing to start" in s for s in said[:2]), said
    assert "restarted 2 times, its limit" in said[2], said
