"""Tools from MCP servers (``env.name: mcp``; the extra ``mcp``: ``pip install -e '.[mcp]'``).

The environment is a :class:`~tidal.envs.tool_env.ToolEnv` whose tools are those of the MCP
servers named in ``env.kwargs.servers``: a stdio server (``command``: its argv, spawned as a
subprocess) or an in-process one (``object``: ``module:attr`` naming an ``MCPServer``/``Server``).

- **Kept alive.** A server is connected once per process (spawning one takes seconds) and shared
  by every episode: :func:`connection` caches the connection by the server's settings; its tool
  list is read once, so every episode lists the same schemas, in the server's order, rendered by
  the chat template into byte-identical prompt tokens (the trainer trains on those very tokens).
- **Errors.** A result with ``is_error`` is the server telling the model its call went wrong: its
  text is the tool message (status ``error``, counted in ``env/tool_errors``), never a crash. A
  call that raises or whose connection broke is a tool failure (``env.tool_failure``).
- **Timeouts.** Each call waits at most ``env.tool_timeout_s`` (the request is cancelled past it):
  a tool failure, also counted in ``env/tool_timeouts``.
- **A server that cannot start** (its command fails, it exits, it does not answer within
  ``connect_timeout_s``) is a one-line ConfigError at ``env.kwargs.servers[i]`` with the last line
  of its log, raised when the environment is first built (``tidal check``, or ``tidal train``
  before any model loads).
- **A server that dies mid-run** (a call fails for its connection, not for its tool) is started
  again and the call retried once, at most ``max_restarts`` times per server and process; each
  restart counts in ``env/server_restarts``. Past the limit its calls are tool failures saying so.
- **Logs.** A stdio server's stderr and an in-process server's ``mcp`` logging go to a file,
  ``RUN_DIR/env_logs/mcp-<server>.log`` in a run (:func:`log_to`), never to the console (a server
  logs every request at INFO).

The ``mcp`` package is imported on first connection only; this module imports neither it nor torch.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from tidal.config_base import ConfigError, build, check
from tidal.envs.adapters import import_object
from tidal.envs.adapters.background import BackgroundLoop
from tidal.envs.config import EnvConfig
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import Tool, ToolArgumentError, ToolFailure


@dataclasses.dataclass(kw_only=True)
class McpServerConfig:
    """One MCP server (``env.kwargs.servers[i]``).

    command: a stdio server's argv (``[python, -m, my_server]``). env / cwd: its environment
        variables (None: the MCP SDK's default, a minimal safe set) and working directory.
    object: instead of ``command``, ``module:attr`` naming an in-process ``MCPServer`` / ``Server``.
    connect_timeout_s: limit of connecting and listing the tools (a stdio server spawns first).
    max_restarts: how many times this server is started again after its connection broke mid-run
        (per process); 0: never.
    """

    command: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    object: str = ""
    connect_timeout_s: float = 60.0
    max_restarts: int = 3

    def __post_init__(self):
        check(bool(self.command) != bool(self.object), "command", "give exactly one of command (a stdio server) and "
                                                                  "object (module:attr of an in-process server)")
        check(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        check(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        check(not self.object or (self.env is None and self.cwd is None), "env", "env and cwd apply to a stdio server (command)")

    @property
    def label(self) -> str:
        """The server as the errors and its log file name it: its command line or ``object``."""
        return " ".join(self.command) if self.command else self.object

    def log_path(self) -> Path:
        """Where its stderr / logging go: ``mcp-<script or object>-<hash of the settings>.log`` in
        the log folder (:func:`log_to`)."""
        words = [w for w in self.command if not w.startswith("-")][1:] or self.command[:1]
        stem = re.sub(r"[^\w.-]+", "_", Path(words[-1]).stem if self.command else self.object)[:40]
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:6]
        return _log_dir() / f"mcp-{stem}-{digest}.log"


class McpConnection:
    """A live client session with one server and its tool list (read once)."""

    def __init__(self, server: McpServerConfig, loop: BackgroundLoop):
        from mcp import Client

        self.loop, self.server = loop, server
        if server.command:
            session = _stdio_session(server)
        else:  # in process
            with _server_logging(server.log_path()):
                session = Client(import_object(server.object, "env.kwargs.servers.object"))
        self.client = loop.hold(session, server.connect_timeout_s)
        self.tools = loop.run(self._list_tools(), server.connect_timeout_s)

    def close(self) -> None:
        """Exit the session (a stdio server's process ends); does not wait for a dead one."""
        self.loop.release(self.client)

    async def _list_tools(self) -> list:
        tools, cursor = [], None
        while True:
            page = await self.client.list_tools(cursor=cursor) if cursor else await self.client.list_tools()
            tools.extend(page.tools)
            cursor = getattr(page, "next_cursor", None)
            if not cursor:
                return tools

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float):
        return self.loop.run(self.client.call_tool(name, arguments), timeout_s)


@contextlib.asynccontextmanager
async def _stdio_session(server: McpServerConfig):
    """An initialised client session with a spawned stdio server (``stdio_client`` and
    ``ClientSession``: the API of every mcp 2.x)."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=server.command[0], args=list(server.command[1:]), env=server.env, cwd=server.cwd)
    with open(server.log_path(), "a", encoding="utf-8") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


@contextlib.contextmanager
def _server_logging(path: Path):
    """Importing an in-process server: what it configures on the root logger (an MCPServer calls
    ``logging.basicConfig(level=INFO)`` with a console handler) is undone, and the ``mcp`` loggers
    write to ``path`` instead of the console."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
        logger = logging.getLogger("mcp")
        if not any(isinstance(h, logging.FileHandler) and h.baseFilename == str(path) for h in logger.handlers):
            logger.addHandler(logging.FileHandler(path, encoding="utf-8"))
        logger.setLevel(logging.INFO)
        logger.propagate = False


_LOG_DIR: list[Path] = []  # the folder of this process's server logs (log_to), else a temporary one made on first use


def log_to(folder: str | Path) -> None:
    """Write the servers' logs connected from now on under ``folder`` (a run's ``RUN_DIR/env_logs``)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    _LOG_DIR[:] = [path]


def _log_dir() -> Path:
    if not _LOG_DIR:
        _LOG_DIR.append(Path(tempfile.mkdtemp(prefix="tidal-mcp-logs-")))
    return _LOG_DIR[0]


def start_error(server: McpServerConfig, error: BaseException) -> str:
    """Why ``server`` did not start, in one line: the error (the first of an exception group) and the
    last line of its log."""
    while getattr(error, "exceptions", None):  # an (anyio) exception group: its first error
        error = error.exceptions[0]
    said = str(error).strip().splitlines()[0] if str(error).strip() else ""
    what = "no answer within connect_timeout_s" if isinstance(error, TimeoutError) else f"{type(error).__name__}: {said}"
    log = server.log_path()
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    tail = f"; its log ends: {lines[-1][:300]!r} ({log})" if lines else f"; its log ({log}) is empty"
    return f"MCP server {server.label!r} did not start ({what}){tail}"


_LOCK = threading.Lock()
_CONNECTIONS: dict[str, McpConnection] = {}
_LOOP: list[BackgroundLoop] = []  # the one loop of this process's connections, made on first use


_RESTARTS: dict[str, int] = {}  # restarts per server (its settings as JSON) in this process


def _key(server: McpServerConfig) -> str:
    return json.dumps(dataclasses.asdict(server), sort_keys=True)


def _connect(server: McpServerConfig) -> McpConnection:
    if not _LOOP:
        _LOOP.append(BackgroundLoop("tidal-mcp"))
        atexit.register(close_all)
    return McpConnection(server, _LOOP[0])


def connection(server: McpServerConfig, key: str = "env.kwargs.servers") -> McpConnection:
    """The process's connection to ``server`` (made on first use, then shared by every episode);
    a server that cannot start is a ConfigError at ``key`` (:func:`start_error`)."""
    with _LOCK:
        if _key(server) not in _CONNECTIONS:
            try:
                _CONNECTIONS[_key(server)] = _connect(server)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 -- spawning, the handshake, a timeout: the server did not start
                raise ConfigError(key, start_error(server, e)) from None
        return _CONNECTIONS[_key(server)]


def restart(server: McpServerConfig, broken: McpConnection) -> McpConnection:
    """A new connection to ``server`` in place of ``broken`` (whose connection failed), counted
    against ``server.max_restarts``; one made meanwhile by another thread is returned as it is.
    ToolFailure when the limit is reached or the server does not start again."""
    with _LOCK:
        current = _CONNECTIONS.get(_key(server))
        if current is not None and current is not broken:
            return current
        used = _RESTARTS.get(_key(server), 0)
        if used >= server.max_restarts:
            raise ToolFailure(f"the MCP server's connection is lost and it was restarted {used} times, its limit "
                              f"(env.kwargs.servers[].max_restarts={server.max_restarts})")
        _RESTARTS[_key(server)] = used + 1
        _CONNECTIONS.pop(_key(server), None)
        broken.close()
        try:
            _CONNECTIONS[_key(server)] = _connect(server)
        except Exception as e:  # noqa: BLE001
            _CONNECTIONS[_key(server)] = broken  # later calls fail on it and try again, within max_restarts
            raise ToolFailure(f"the MCP server's connection is lost and it did not start again: {start_error(server, e)}") from None
        return _CONNECTIONS[_key(server)]


def close_all() -> None:
    """Close every connection (stdio servers exit) and the loop; the next use connects again."""
    with _LOCK:
        _CONNECTIONS.clear()
        _RESTARTS.clear()
        if _LOOP:
            _LOOP.pop().close()


def result_text(result: Any) -> str:
    """The model's view of a tool result: its text blocks joined by newlines; a block of another
    kind is named (``[image content]``); no content: the structured content as JSON."""
    parts = [block.text if getattr(block, "type", "") == "text" else f"[{getattr(block, 'type', 'unknown')} content]"
             for block in result.content or []]
    if not parts and getattr(result, "structured_content", None) is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


class McpTool(Tool):
    """One tool of a server. ``timeouts``: calls of this instance that ran past their limit;
    ``restarts``: server restarts its calls made (module docstring)."""

    runs_own_timeout = True  # the request is cancelled on the client's loop at the limit

    def __init__(self, conn: McpConnection, spec: Any):
        self.conn, self.name = conn, spec.name
        self.description = spec.description or ""
        self.parameters = dict(spec.input_schema)
        self.timeouts = self.restarts = 0

    def call(self, arguments: dict[str, Any], *, timeout_s: float) -> str:
        try:
            result = self._call(arguments, timeout_s)
        except TimeoutError:
            self.timeouts += 1
            raise ToolFailure(f"timed out after {timeout_s:g} s") from None
        if result.is_error:  # the server's word to the model: an observation, the model's error
            raise ToolArgumentError(result_text(result))
        return result_text(result)

    def _call(self, arguments: dict[str, Any], timeout_s: float):
        """The call on the server's current connection; a call that fails for its connection (the
        tool's own errors come back as results) restarts the server and is made once more."""
        conn = connection(self.conn.server)
        try:
            return conn.call(self.name, arguments, timeout_s)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001 -- the transport's error (closed stream, broken pipe, MCPError)
            first = f"{type(e).__name__}: {e}"
        fresh = restart(self.conn.server, conn)
        self.restarts += fresh is not conn
        try:
            return fresh.call(self.name, arguments, timeout_s)
        except TimeoutError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ToolFailure(f"the MCP server's connection failed ({first}), and again after a restart: {type(e).__name__}: {e}") from None


class McpEnv(ToolEnv):
    """Tool use with the tools of MCP servers (module docstring). Settings (``env.kwargs``):
    ``servers`` (a list of :class:`McpServerConfig`), ``tools`` (the names to offer, in this order;
    default every tool of every server, in server order), and :class:`ToolEnv`'s."""

    name = "mcp"
    counter_names = ToolEnv.counter_names + ("tool_timeouts", "server_restarts")

    def __init__(self, cfg: EnvConfig, *, servers: list[dict] | None = None, tools: list[str] | None = None, **kwargs: Any):
        check(bool(servers) and isinstance(servers, list), "env.kwargs.servers", "must list at least one MCP server")
        self.servers = [build(McpServerConfig, s, prefix=f"env.kwargs.servers[{i}]") for i, s in enumerate(servers)]
        self.only = tools
        super().__init__(cfg, **kwargs)

    @classmethod
    def log_to(cls, folder: str) -> None:
        log_to(folder)

    def make_tools(self) -> list[Tool]:
        conns = [connection(s, f"env.kwargs.servers[{i}]") for i, s in enumerate(self.servers)]
        found = [McpTool(conn, spec) for conn in conns for spec in conn.tools]
        if self.only is None:
            return found
        by_name = {t.name: t for t in found}
        missing = [n for n in self.only if n not in by_name]
        if missing:
            raise ConfigError("env.kwargs.tools", f"no MCP tool named {missing}; the servers offer {sorted(by_name)}")
        return [by_name[n] for n in self.only]

    def step(self, turn):
        tools = self.toolset.tools.values()
        before = [sum(t.timeouts for t in tools), sum(t.restarts for t in tools)]
        result = super().step(turn)
        result.counters["tool_timeouts"] = float(sum(t.timeouts for t in tools) - before[0])
        result.counters["server_restarts"] = float(sum(t.restarts for t in tools) - before[1])
        return result
