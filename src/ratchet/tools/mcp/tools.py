"""An MCP server's tools as ratchet tools: names, risk from the annotations, recovery and
fences from what the server advertises."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types
from pydantic import BaseModel

from ratchet.errors import (
    AdapterError,
    ConfigurationError,
)
from ratchet.runtime.actions import Risk
from ratchet.runtime.catalog import TOOL_NAME_PATTERN
from ratchet.runtime.ports import Fence
from ratchet.tools.declare import RecordedCall, Tool, ToolCall
from ratchet.tools.mcp.arguments import schema_model
from ratchet.tools.mcp.connection import MCPConnection
from ratchet.tools.mcp.recipes import KeyRecipe
from ratchet.tools.mcp.wire import (
    _HIDDEN,
    META_FENCE,
    META_IDEMPOTENCY_KEY,
    _joined_text,
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


#: Risks from the least to the most strict.
_STRICTNESS = (Risk.READ_ONLY, Risk.REVERSIBLE_WRITE, Risk.IRREVERSIBLE_EXTERNAL_WRITE)


@dataclass(frozen=True, slots=True)
class McpDeclaration:
    """The operator's declaration of one MCP tool, over what its annotations hint (which
    are the server's and untrusted): ``risk`` and ``idempotent`` may only make the tool
    stricter (a riskier class; not idempotent) unless :func:`mcp_tools` is told to
    ``loosen``; ``refusal`` is a regular expression: a result whose text matches it is a
    refusal with no effect (for a server that answers a failed write with ordinary text);
    ``keys`` makes the tool recover by lookup (:class:`~ratchet.tools.mcp.recipes.
    KeyRecipe`)."""

    risk: Risk | None = None
    idempotent: bool | None = None
    refusal: str | None = None
    keys: KeyRecipe | None = None


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

    def __init__(
        self,
        connection: MCPConnection,
        remote: mcp_types.Tool,
        *,
        name: str,
        declared: McpDeclaration | None = None,
        loosen: bool = False,
    ) -> None:
        hinted_risk = mcp_risk(remote.annotations)
        hinted = remote.annotations is not None and remote.annotations.idempotent_hint is True
        declared = declared or McpDeclaration()
        risk = _declared_risk(remote.name, hinted_risk, declared.risk, loosen)
        if declared.idempotent is True and not hinted and not loosen:
            raise ConfigurationError(
                f"MCP tool {remote.name!r}: declaring it idempotent loosens what its server "
                "says (it would be called again after a cut-off call); pass loosen=True if "
                "the server really dedupes",
                field="declare",
                tool=remote.name,
            )
        if declared.idempotent is not None:
            hinted = declared.idempotent
        extensions = connection.extensions
        self.connection = connection
        self.remote_name = remote.name
        self.name = name  # type: ignore[misc]  # instance values of the class form's fields
        self.risk = risk  # type: ignore[misc]
        self.description = (remote.description or f"MCP tool {remote.name}").strip()  # type: ignore[misc]
        self.idempotent = risk.is_write and (hinted or connection.supports_idempotency_key)  # type: ignore[misc]
        self._keys = declared.keys if risk.is_write else None
        # A placeholder recipe refuses, at the gate, a call that could not carry its key.
        check = self._keys.missing if self._keys and self._keys.placeholder else None
        self.Args = schema_model(name, remote.input_schema, check=check)  # type: ignore[misc]
        if declared.idempotent is False:
            self.idempotent = False  # type: ignore[misc]
        self._fences = risk.is_write and extensions.fences
        self._lookup = risk.is_write and extensions.lookup
        self._refusal = re.compile(declared.refusal) if declared.refusal else None
        if self._keys is not None:
            _check_recipe(remote, self._keys)
            self._lookup = True
            self.description += self._keys.note  # type: ignore[misc]

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
        if self._keys is not None and call.idempotency_key is not None:
            # The arguments as proposed (the intent digest covers them) with the key, and
            # the intent digest for an intent recipe, written in: fixed by the two.
            arguments = self._keys.carried(
                arguments, call.idempotency_key, call.intent_digest, self.name
            )
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
        if self._refusal is not None and self._refusal.search(_joined_text(result)):
            raise AdapterError(
                f"tool {self.name}: the MCP server refused the call: "
                f"{self.connection.scrub(_joined_text(result))[:200]}",
                retryable=False,
                tool=self.name,
            )
        return tool_output(result)

    def lookup(self, key: str, call: RecordedCall | None = None) -> Any | None:
        """The server's ``ratchet_lookup``, or the key recipe's read: the call's output
        (a :class:`~ratchet.tools.declare.Found` when the read shows its intent), or None.

        Raises:
            AdapterError: the read failed or cannot say (retryable=True).
        """
        if not self._lookup:
            raise NotImplementedError
        recipe = self._keys
        if recipe is None:
            return self.connection.lookup(self.remote_name, key)
        result = self.connection.call_tool(recipe.tool, recipe.lookup_arguments(key, self.name))
        if result.is_error:
            raise AdapterError(
                f"tool {self.name}: the lookup's read tool {recipe.tool!r} failed; the key "
                "stays unknown",
                retryable=True,
                tool=self.name,
            )
        return recipe.found(result, key, call.intent_digest if call else None, self.name)

    def raise_fence(self, fence: Fence) -> None:
        if not self._fences:
            raise NotImplementedError
        self.connection.raise_fence(fence)

    def close(self) -> None:
        """The connection is the caller's: :func:`mcp_tools` does not close it."""


def _declared_risk(tool: str, hinted: Risk, declared: Risk | None, loosen: bool) -> Risk:
    """The tool's risk: the hint, or the operator's declaration when it is at least as
    strict (or ``loosen`` allows it).

    Raises:
        ConfigurationError: a declaration that loosens the hint without ``loosen``.
    """
    if declared is None:
        return hinted
    if _STRICTNESS.index(declared) < _STRICTNESS.index(hinted) and not loosen:
        raise ConfigurationError(
            f"MCP tool {tool!r}: declaring it {declared.value} loosens what its annotations "
            f"say ({hinted.value}); pass loosen=True to take the declaration over them",
            field="declare",
            tool=tool,
        )
    return declared


def _check_recipe(remote: mcp_types.Tool, recipe: KeyRecipe) -> None:
    """The carrying argument must be one of the write's string arguments (the read tool
    is checked by :func:`mcp_tools`, which knows the listing).

    Raises:
        ConfigurationError: it is not.
    """
    properties = (remote.input_schema or {}).get("properties", {})
    found = properties.get(recipe.carry) if isinstance(properties, dict) else None
    if not isinstance(found, dict) or found.get("type") != "string":
        raise ConfigurationError(
            f"MCP tool {remote.name!r}: the key recipe's argument {recipe.carry!r} is not "
            "a string argument of the tool",
            field="declare",
            tool=remote.name,
        )


def mcp_tools(
    connection: MCPConnection,
    *,
    prefix: str = "",
    include: Collection[str] | None = None,
    declare: Mapping[str, McpDeclaration] | None = None,
    loosen: bool = False,
) -> list[Tool]:
    """The server's tools (but the hidden extension tools) as ratchet tools, named
    ``prefix`` + the MCP name (sanitised); ``include`` (MCP names) keeps only those.
    Starts the connection if needed.

    ``declare`` holds the operator's declarations by MCP name (:class:`McpDeclaration`):
    risk and idempotency only stricter than the server's hints unless ``loosen``, a
    refusal pattern, a key recipe. A declaration for a tool the server does not list is
    refused.

    Raises:
        ConfigurationError: an included or declared name the server does not list, a
            name that cannot be made a tool name or that two tools share, a schema ratchet
            cannot take (floats, not an object schema), or a declaration that loosens
            without ``loosen`` or names no string argument to carry the key.
        AdapterError: the server could not be reached (retryable=True).
    """
    connection.start()
    listed = [t for t in connection.list_tools() if t.name not in _HIDDEN]
    every = {t.name for t in listed}
    if include is not None:
        wanted = set(include)
        missing = sorted(wanted - {t.name for t in listed})
        if missing:
            raise ConfigurationError(
                f"the MCP server lists no tool {missing[0]!r}", field="include", tool=missing[0]
            )
        listed = [t for t in listed if t.name in wanted]
    unknown = sorted(set(declare or {}) - every)
    if unknown:
        raise ConfigurationError(
            f"a declaration names MCP tool {unknown[0]!r}, which the server does not list",
            field="declare",
            tool=unknown[0],
        )
    for declared_name, declared in (declare or {}).items():
        if declared.keys is not None and declared.keys.tool not in every:
            raise ConfigurationError(
                f"MCP tool {declared_name!r}: the key recipe's read tool "
                f"{declared.keys.tool!r} is not a tool the server lists",
                field="declare",
                tool=declared_name,
            )
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
        made_tool = MCPTool(
            connection,
            remote,
            name=name,
            declared=(declare or {}).get(remote.name),
            loosen=loosen,
        )
        made_tool.spec  # noqa: B018 - declaration errors surface here, not at first call
        made.append(made_tool)
    return made
