"""A local MCP server for the adapter's tests, run over stdio (``python tests/ecosystem/mcp_server.py``)
or in process (``tests.ecosystem.mcp_server:server``). Its tools: ``add`` (two integers), ``divide``
(an ``is_error`` result on a zero divisor), ``sleep`` (answers after ``seconds``) and ``pid`` (the
server's process id: one server for every episode; logged at INFO, as servers log their requests)."""

import logging
import os
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("tidal-test")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def divide(a: int, b: int) -> str:
    """Divide a by b."""
    if b == 0:
        raise ToolError("division by zero")
    return str(a / b)


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def pid() -> str:
    """The server's process id."""
    logging.getLogger("tidal-test-server").info("pid asked")  # a server's INFO chatter: to its log file, not the console
    return str(os.getpid())


if __name__ == "__main__":
    logging.getLogger("tidal-test-server").info("serving over stdio")
    server.run()
