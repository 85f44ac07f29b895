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

The ``mcp`` package is imported on first connection only; this module imports neither it nor torch.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import threading
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
    """

    command: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None
    object: str = ""
    connect_timeout_s: float = 60.0

    def __post_init__(self):
        check(bool(self.command) != bool(self.object), "command", "give exactly one of command (a stdio server) and "
                                                                  "object (module:attr of an in-process server)")
        check(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        check(not self.object or (self.env is None and self.cwd is None), "env", "env and cwd apply to a stdio server (command)")


class McpConnection:
    """A live client session with one server and its tool list (read once)."""

    def __init__(self, server: McpServerConfig, loop: BackgroundLoop):
        from mcp import Client

        if server.command:
            session = _stdio_session(server)
        else:  # in process
            session = Client(import_object(server.object, "env.kwargs.servers.object"))
        self.loop = loop
        self.client = loop.hold(session, server.connect_timeout_s)
        self.tools = loop.run(self._list_tools(), server.connect_timeout_s)

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
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


_LOCK = threading.Lock()
_CONNECTIONS: dict[str, McpConnection] = {}
_LOOP: list[BackgroundLoop] = []  # the one loop of this process's connections, made on first use


def connection(server: McpServerConfig) -> McpConnection:
    """The process's connection to ``server`` (made on first use, then shared by every episode)."""
    key = json.dumps(dataclasses.asdict(server), sort_keys=True)
    with _LOCK:
        if key not in _CONNECTIONS:
            if not _LOOP:
                _LOOP.append(BackgroundLoop("tidal-mcp"))
                atexit.register(close_all)
            _CONNECTIONS[key] = McpConnection(server, _LOOP[0])
        return _CONNECTIONS[key]


def close_all() -> None:
    """Close every connection (stdio servers exit) and the loop; the next use connects again."""
    with _LOCK:
        _CONNECTIONS.clear()
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
    """One tool of a server. ``timeouts``: calls of this instance that ran past their limit."""

    runs_own_timeout = True  # the request is cancelled on the client's loop at the limit

    def __init__(self, conn: McpConnection, spec: Any):
        self.conn, self.name = conn, spec.name
        self.description = spec.description or ""
        self.parameters = dict(spec.input_schema)
        self.timeouts = 0

    def call(self, arguments: dict[str, Any], *, timeout_s: float) -> str:
        try:
            result = self.conn.call(self.name, arguments, timeout_s)
        except TimeoutError:
            self.timeouts += 1
            raise ToolFailure(f"timed out after {timeout_s:g} s") from None
        if result.is_error:  # the server's word to the model: an observation, the model's error
            raise ToolArgumentError(result_text(result))
        return result_text(result)


class McpEnv(ToolEnv):
    """Tool use with the tools of MCP servers (module docstring). Settings (``env.kwargs``):
    ``servers`` (a list of :class:`McpServerConfig`), ``tools`` (the names to offer, in this order;
    default every tool of every server, in server order), and :class:`ToolEnv`'s."""

    name = "mcp"
    counter_names = ToolEnv.counter_names + ("tool_timeouts",)

    def __init__(self, cfg: EnvConfig, *, servers: list[dict] | None = None, tools: list[str] | None = None, **kwargs: Any):
        check(bool(servers) and isinstance(servers, list), "env.kwargs.servers", "must list at least one MCP server")
        self.servers = [build(McpServerConfig, s, prefix=f"env.kwargs.servers[{i}]") for i, s in enumerate(servers)]
        self.only = tools
        super().__init__(cfg, **kwargs)

    def make_tools(self) -> list[Tool]:
        found = [McpTool(conn, spec) for conn in map(connection, self.servers) for spec in conn.tools]
        if self.only is None:
            return found
        by_name = {t.name: t for t in found}
        missing = [n for n in self.only if n not in by_name]
        if missing:
            raise ConfigError("env.kwargs.tools", f"no MCP tool named {missing}; the servers offer {sorted(by_name)}")
        return [by_name[n] for n in self.only]

    def step(self, turn):
        before = sum(t.timeouts for t in self.toolset.tools.values())
        result = super().step(turn)
        result.counters["tool_timeouts"] = float(sum(t.timeouts for t in self.toolset.tools.values()) - before)
        return result
