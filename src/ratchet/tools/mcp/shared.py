"""Stdio MCP servers kept for the worker's life: what a tool package uses so that jobs do
not start its server again each time.

A tool package's factory runs in every job that needs its tools (``ratchet.tools``
entry points). With :func:`shared_stdio` it gets the process's one connection to that
server (same program, arguments, environment and folder): started on first use, handed
to every later job (after a probe: one round trip), started again when it died (a
connection whose server exited or stopped answering is never handed out), and closed
when the process stops (:func:`close_shared`, which the worker calls; ``atexit`` too).
The tools' listing is kept with the connection (:meth:`MCPConnection.list_tools` asks
once per connection), so a job that uses a shared server costs its calls only.

    # a tool package
    from ratchet.tools.mcp import mcp_tools, shared_stdio

    def git_tools():
        return mcp_tools(shared_stdio(["mcp-server-git", "--repository", "/srv/repo"]),
                         prefix="git_")

Tools made from a shared connection do not close it when a job ends (nor does any
:class:`~ratchet.tools.mcp.MCPTool`: a connection is its maker's).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ratchet.tools.mcp.connection import MCPConnection

__all__ = ["close_shared", "shared_count", "shared_stdio"]

_Key = tuple[tuple[str, ...], tuple[tuple[str, str], ...], str | None]

_lock = threading.Lock()
_pool: dict[_Key, MCPConnection] = {}


def shared_stdio(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    **options: Any,
) -> MCPConnection:
    """This process's started connection to the stdio server ``argv`` (with ``env`` and
    ``cwd``): the one made before while its server lives, else a new one (``options``
    as :meth:`MCPConnection.stdio`).

    Raises:
        ConfigurationError: an empty ``argv``, a bad option.
        AdapterError: the server could not be started or connected (retryable=True).
    """
    key: _Key = (
        tuple(argv),
        tuple(sorted((env or {}).items())),
        str(cwd) if cwd is not None else None,
    )
    with _lock:
        found = _pool.get(key)
    # A server that died between jobs is found by a probe (one round trip), not by the
    # next job's first call.
    if found is not None and found.alive and found.probe():
        return found
    if found is not None:
        with _lock:
            if _pool.get(key) is found:
                del _pool[key]
        found.close()  # its server died: a new one is started below
    made = MCPConnection.stdio(argv, env=env, cwd=cwd, **options).start()
    with _lock:
        raced = _pool.get(key)
        if raced is None or not raced.alive:
            _pool[key] = made
            return made
    made.close()  # another thread made one first: that one is shared
    return raced


def shared_count() -> int:
    """How many shared connections this process holds."""
    with _lock:
        return len(_pool)


def close_shared() -> None:
    """Close every shared connection (their servers are stopped). Idempotent."""
    with _lock:
        held = list(_pool.values())
        _pool.clear()
    for conn in held:
        conn.close()


atexit.register(close_shared)
