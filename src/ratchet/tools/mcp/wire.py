"""The wire: what ratchet sends an MCP server beside a call, and how it reads a result.

Request ``_meta`` keys, the error markers a server answers with, the capabilities ratchet
reads, the hidden extension tools, and the reading of a call's result into an output or
a typed error (see the package docstring for the whole convention).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import mcp_types
from mcp import MCPError

from ratchet.errors import (
    AdapterError,
    FenceRejectedError,
    IdempotencyConflictError,
)
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.ports import Fence
from ratchet.tools.adapter import MAX_OUTPUT_CHARS

log = logging.getLogger(__name__)

#: Request ``_meta`` keys ratchet sends, and the result marker a server answers with.
META_FENCE = "ratchet/fence"
META_IDEMPOTENCY_KEY = "ratchet/idempotencyKey"
META_ERROR = "ratchet/error"
#: The marker's values: a stale fence refused, a key reused for other arguments.
FENCE_REJECTED = "fence_rejected"
IDEMPOTENCY_CONFLICT = "idempotency_conflict"
#: Experimental capabilities: SEP-3182's ``idempotencyKey``, and ratchet's extensions.
SEP3182_CAPABILITY = "idempotencyKey"
EXTENSION_CAPABILITY = "ratchet"
#: The extension tools, never offered as tools of their own.
RAISE_FENCE_TOOL = "ratchet_raise_fence"
LOOKUP_TOOL = "ratchet_lookup"
_HIDDEN = frozenset({RAISE_FENCE_TOOL, LOOKUP_TOOL})

# JSON-RPC errors that say the request was refused as such (nothing ran).
_REFUSED_CODES = frozenset(
    {
        mcp_types.PARSE_ERROR,
        mcp_types.INVALID_REQUEST,
        mcp_types.METHOD_NOT_FOUND,
        mcp_types.INVALID_PARAMS,
        mcp_types.HEADER_MISMATCH,
    }
)


def fence_payload(fence: Fence) -> dict[str, Any]:
    """``fence`` as ratchet sends it (``_meta["ratchet/fence"]``, ``ratchet_raise_fence``)."""
    return {
        "run_id": fence.run_id,
        "lease_version": fence.lease_version,
        "state_version": fence.state_version,
        "store_epoch": fence.store_epoch,
    }


def _what_failed(exc: BaseException) -> str:
    """What failed, in a few words: inside an exception group (the transport's task
    group), the first error a server answered with, else the first failure."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        inner = [_what_failed(e) for e in exc.exceptions]
        return next((said for said in inner if said.startswith("code ")), inner[0])
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, MCPError):
        return f"code {exc.code}"
    return type(exc).__name__


def _marked(value: Any) -> str | None:
    return value if value in (FENCE_REJECTED, IDEMPOTENCY_CONFLICT) else None


def _marked_error(marker: str, tool: str, text: str) -> AdapterError:
    if marker == FENCE_REJECTED:
        return FenceRejectedError(
            f"tool {tool}: the MCP server has seen a newer fence and refused the call",
            tool=tool,
        )
    return IdempotencyConflictError(
        f"tool {tool}: the MCP server holds this key for other arguments: {text}", tool=tool
    )


def _joined_text(result: mcp_types.CallToolResult) -> str:
    texts = [b.text for b in result.content if isinstance(b, mcp_types.TextContent)]
    return "\n".join(texts)[:MAX_OUTPUT_CHARS]


def _kept(output: Any) -> Any:
    """An output as a receipt can keep it: canonical JSON has no floats, so a value with
    one is kept as its JSON text."""
    try:
        canonical_json(output)
    except Exception:
        return json.dumps(output, sort_keys=True, separators=(",", ":"))[:MAX_OUTPUT_CHARS]
    return output


def tool_output(result: mcp_types.CallToolResult) -> Any:
    """The output a receipt keeps: ``structuredContent`` when present, else the text
    contents joined by newlines (cut at :data:`~ratchet.tools.adapter.MAX_OUTPUT_CHARS`)."""
    if result.structured_content is not None:
        return _kept(result.structured_content)
    return _joined_text(result)
