"""An MCP server's tools as ratchet tools: names, risk from the annotations, recovery and
fences from what the server advertises."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import mcp_types
from pydantic import BaseModel

from ratchet.errors import (
    ConfigurationError,
)
from ratchet.runtime.actions import Risk
from ratchet.runtime.ports import Fence
from ratchet.runtime.tools import TOOL_NAME_PATTERN
from ratchet.tools.declare import Tool, ToolCall
from ratchet.tools.mcp.connection import MCPConnection
from ratchet.tools.mcp.schema import schema_model
from ratchet.tools.mcp.wire import (
    _HIDDEN,
    META_FENCE,
    META_IDEMPOTENCY_KEY,
    fence_payload,
    tool_output,
)


def mcp_risk(annotations: mcp_types.ToolAnnotations | None) -> Risk:
    """The risk of a tool with these annotations: ``readOnlyHint`` is a read; otherwise
    ``destructiveHint: false`` is a reversible write (``readOnlyHint`` defaults to false),
    and ``destructiveHint`` (or no hint at all) an irreversible external write."""
    hints = annotations or mcp_types.ToolAnnotations()
    if hints.read_only_hint is True:
        return Risk.READ_ONLY
    if hints.destructive_hint is False:
        return Risk.REVERSIBLE_WRITE
    return Risk.IRREVERSIBLE_EXTERNAL_WRITE


def tool_name(prefix: str, mcp_name: str) -> str:
    """``prefix + mcp_name`` with every character a tool name may not hold made ``_``.

    Raises:
        ConfigurationError: the result still does not match the tool name pattern (it
            does not start with a letter, or is longer than 64 characters).
    """
    name = re.sub(r"[^A-Za-z0-9_-]", "_", prefix + mcp_name)
    if not re.match(TOOL_NAME_PATTERN, name):  # no newline is left for "$" to allow
        raise ConfigurationError(
            f"MCP tool {mcp_name!r} cannot be named {name!r} here (a tool name must match "
            f"{TOOL_NAME_PATTERN})",
            field="tools",
            tool=mcp_name,
        )
    return name


class MCPTool(Tool):
    """One MCP server tool as a ratchet tool (made by :func:`mcp_tools`).

    Its risk comes from the tool's annotations (:func:`mcp_risk`); it is idempotent when it
    says so (``idempotentHint``) or the server dedupes by key (SEP-3182); a write checks
    fences and recovers by lookup when the server offers the ratchet extensions.
    """

    def __init__(self, connection: MCPConnection, remote: mcp_types.Tool, *, name: str) -> None:
        risk = mcp_risk(remote.annotations)
        hinted = remote.annotations is not None and remote.annotations.idempotent_hint is True
        extensions = connection.extensions
        self.connection = connection
        self.remote_name = remote.name
        self.name = name  # type: ignore[misc]  # instance values of the class form's fields
        self.risk = risk  # type: ignore[misc]
        self.description = (remote.description or f"MCP tool {remote.name}").strip()  # type: ignore[misc]
        self.idempotent = risk.is_write and (hinted or connection.supports_idempotency_key)  # type: ignore[misc]
        self.Args = schema_model(name, remote.input_schema)  # type: ignore[misc]
        self._fences = risk.is_write and extensions.fences
        self._lookup = risk.is_write and extensions.lookup

    def __repr__(self) -> str:
        return f"MCPTool(name={self.name!r}, mcp={self.remote_name!r})"

    @property
    def has_lookup(self) -> bool:
        return self._lookup

    @property
    def checks_fences(self) -> bool:
        return self._fences

    def run(self, args: Any, call: ToolCall) -> Any:
        """Call the server's tool; its output (see :func:`tool_output`).

        Raises:
            FenceRejectedError: the server has seen a newer fence for the run.
            IdempotencyConflictError: the server holds the key for other arguments.
            AdapterError: a refusal with no effect (retryable=False), or an outcome
                unknown (retryable=True).
        """
        arguments = args.model_dump(mode="json") if isinstance(args, BaseModel) else dict(args)
        meta: dict[str, Any] = {}
        if call.fence is not None:
            meta[META_FENCE] = fence_payload(call.fence)
        sent_key: str | None = None
        if call.idempotency_key is not None:
            if self.connection.supports_idempotency_key:
                sent_key = call.idempotency_key
            else:
                meta[META_IDEMPOTENCY_KEY] = call.idempotency_key
        result = self.connection.call_tool(
            self.remote_name, arguments, meta=meta, idempotency_key=sent_key
        )
        if result.is_error:
            raise self.connection.tool_error(self.name, result)
        return tool_output(result)

    def lookup(self, key: str) -> Any | None:
        if not self._lookup:
            raise NotImplementedError
        return self.connection.lookup(self.remote_name, key)

    def raise_fence(self, fence: Fence) -> None:
        if not self._fences:
            raise NotImplementedError
        self.connection.raise_fence(fence)

    def close(self) -> None:
        """The connection is the caller's: :func:`mcp_tools` does not close it."""


def mcp_tools(
    connection: MCPConnection, *, prefix: str = "", include: Collection[str] | None = None
) -> list[Tool]:
    """The server's tools (but the hidden extension tools) as ratchet tools, named
    ``prefix`` + the MCP name (sanitised); ``include`` (MCP names) keeps only those.
    Starts the connection if needed.

    Raises:
        ConfigurationError: an included name the server does not list, a name that cannot
            be made a tool name or that two tools share, or a schema ratchet cannot take
            (floats, not an object schema).
        AdapterError: the server could not be reached (retryable=True).
    """
    connection.start()
    listed = [t for t in connection.list_tools() if t.name not in _HIDDEN]
    if include is not None:
        wanted = set(include)
        missing = sorted(wanted - {t.name for t in listed})
        if missing:
            raise ConfigurationError(
                f"the MCP server lists no tool {missing[0]!r}", field="include", tool=missing[0]
            )
        listed = [t for t in listed if t.name in wanted]
    made: list[Tool] = []
    named: dict[str, str] = {}
    for remote in listed:
        name = tool_name(prefix, remote.name)
        if name in named:
            raise ConfigurationError(
                f"MCP tools {named[name]!r} and {remote.name!r} would both be named {name!r}",
                field="tools",
                tool=name,
            )
        named[name] = remote.name
        made_tool = MCPTool(connection, remote, name=name)
        made_tool.spec  # noqa: B018 - declaration errors surface here, not at first call
        made.append(made_tool)
    return made
