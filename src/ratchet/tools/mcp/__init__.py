"""MCP servers as fenced environments: a server's tools as ratchet tools (``ratchet[mcp]``).

:class:`MCPConnection` is a synchronous handle on one MCP server, over stdio (a command
ratchet starts) or streamable HTTP (a URL). It runs the ``mcp`` package's async client on
an event loop of its own, in a background thread; every call has a deadline, and a dead
server or a broken transport is :class:`~ratchet.errors.AdapterError` with
``retryable=True``. An answer is read at most up to a byte cap (``RATCHET_MAX_PEER_BYTES``),
while it streams in (:mod:`ratchet.tools.mcp.transports`); past it the call fails with
:class:`~ratchet.errors.PeerAnswerTooLargeError`. :func:`mcp_tools` turns the server's
tools into ratchet tools (:class:`MCPTool`), which a :class:`~ratchet.tools.Toolbox`
makes a run's environment.

A call, on the wire (docs/mcp.md has the whole walkthrough)::

    tools/call {name, arguments,
                idempotencyKey: KEY                  (a server that advertises SEP-3182)
                _meta: {"ratchet/idempotencyKey": KEY   (any other server)
                        "ratchet/fence": {run_id, lease_version, state_version, store_epoch}}}

A tool error result (``isError``) is a refusal with no effect, unless it is marked (in its
``_meta`` or its ``structuredContent``) ``"ratchet/error": "fence_rejected"``
(:class:`~ratchet.errors.FenceRejectedError`) or ``"idempotency_conflict"``
(:class:`~ratchet.errors.IdempotencyConflictError`); a JSON-RPC error carrying the same
marker in its ``data`` means the same. Any other JSON-RPC error but a malformed or
unknown request, a timeout and a lost connection leave the call's outcome unknown, for
recovery.

Server capabilities read (experimental, since the SDK's capability models drop unknown
fields): ``{"idempotencyKey": {}}`` (SEP-3182: the key goes beside ``arguments`` and the
server dedupes by it, so its write tools are idempotent) and
``{"ratchet": {"fences": true, "lookup": true}}``: the hidden tools ``ratchet_raise_fence``
(its write tools then check fences) and ``ratchet_lookup`` (its write tools then recover by
lookup).

A server that offers neither recovers by a declared recipe instead
(:mod:`ratchet.tools.mcp.recipes`: the key kept in what the write writes, found by a read
of the same server), e.g. ``git_trailer`` for ``mcp-server-git`` and ``sql_key_column`` for
a SQL server.
"""

from __future__ import annotations

from ratchet.tools.mcp.arguments import SchemaArgs, schema_model
from ratchet.tools.mcp.connection import MCPConnection, RatchetExtensions
from ratchet.tools.mcp.recipes import KeyRecipe
from ratchet.tools.mcp.shared import close_shared, shared_count, shared_stdio
from ratchet.tools.mcp.tools import (
    McpDeclaration,
    MCPTool,
    mcp_risk,
    mcp_tools,
    tool_name,
)
from ratchet.tools.mcp.wire import (
    EXTENSION_CAPABILITY,
    FENCE_REJECTED,
    IDEMPOTENCY_CONFLICT,
    LOOKUP_TOOL,
    META_ERROR,
    META_FENCE,
    META_IDEMPOTENCY_KEY,
    RAISE_FENCE_TOOL,
    SEP3182_CAPABILITY,
    fence_payload,
    tool_output,
)

__all__ = [
    "EXTENSION_CAPABILITY",
    "FENCE_REJECTED",
    "IDEMPOTENCY_CONFLICT",
    "LOOKUP_TOOL",
    "META_ERROR",
    "META_FENCE",
    "META_IDEMPOTENCY_KEY",
    "RAISE_FENCE_TOOL",
    "SEP3182_CAPABILITY",
    "KeyRecipe",
    "MCPConnection",
    "MCPTool",
    "McpDeclaration",
    "RatchetExtensions",
    "SchemaArgs",
    "close_shared",
    "fence_payload",
    "mcp_risk",
    "mcp_tools",
    "schema_model",
    "shared_count",
    "shared_stdio",
    "tool_name",
    "tool_output",
]
