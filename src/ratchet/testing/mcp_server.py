"""A small tickets service as a real MCP server (the ``mcp`` package's low-level server),
for tests and demos of :mod:`ratchet.tools.mcp`::

    python -m ratchet.testing.mcp_server --state DIR [--transport stdio|http --port N]
        [--fences] [--lookup] [--sep3182] [--idempotent] [--estimates] [--modern-only]
        [--pid-file PATH]

Tools: ``create_ticket(title, body)`` (``destructiveHint``; with ``--idempotent`` also
``idempotentHint``), ``list_tickets()`` and ``tickets.search(query)`` (``readOnlyHint``),
``close_ticket(ticket_id)`` (``readOnlyHint: false, destructiveHint: false``),
``comment_ticket(ticket_id, text)`` (no annotations) and, with ``--estimates``,
``estimate_ticket(ticket_id, hours)`` whose ``hours`` is a JSON number.

State is one SQLite file in DIR, durable and shared by every server started on it (a
restarted server, or two at once): the tickets, counters (``effects``: tickets actually
created; ``calls``: ``create_ticket`` requests received; ``refused_stale``; ``conflicts``;
``replays``), the output of each call made with an idempotency key and, with
``--fences``, the highest fence per run. :func:`stats` reads the counters.

A write's idempotency key is ``params.idempotencyKey`` (SEP-3182) or
``_meta["ratchet/idempotencyKey"]``. With ``--sep3182`` (advertised as the experimental
capability ``idempotencyKey``) or ``--idempotent`` the server dedupes by it: the same key
with the same arguments returns the stored output and has no new effect, the same key with
other arguments is a conflict (a JSON-RPC error with ``--sep3182``, as the proposal has
it; an ``isError`` result otherwise, both marked ``"ratchet/error":
"idempotency_conflict"``). Otherwise a key is only recorded, for ``ratchet_lookup``.

``--fences`` and ``--lookup`` advertise ``{"ratchet": {"fences": ..., "lookup": ...}}`` and
offer the hidden tools ``ratchet_raise_fence`` and ``ratchet_lookup``; a fencing server
refuses a write or a raise whose ``(lease_version, state_version)`` is below the highest it
has seen for the run, or whose store epoch is not the first it saw (an ``isError`` result
marked ``"ratchet/error": "fence_rejected"``, counted in ``refused_stale``).

Over HTTP, when the environment variable ``TICKETS_TOKEN`` is set, every request must
carry ``Authorization: Bearer <token>``.

The SDK's server speaks both protocol eras (the client's first request picks one). With
``--modern-only`` it refuses the ``initialize`` handshake as a server of the 2026-07-28
protocol alone does (``UnsupportedProtocolVersionError`` naming the versions it speaks), so
a client that starts with ``initialize`` must fall forward to ``server/discover``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import uvicorn
from jsonschema.validators import validator_for  # type: ignore[import-untyped]
from mcp import MCPError
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.stdio import stdio_server
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ratchet.tools.mcp import (
    EXTENSION_CAPABILITY,
    FENCE_REJECTED,
    IDEMPOTENCY_CONFLICT,
    LOOKUP_TOOL,
    META_ERROR,
    META_FENCE,
    META_IDEMPOTENCY_KEY,
    RAISE_FENCE_TOOL,
    SEP3182_CAPABILITY,
)

__all__ = ["DB_NAME", "Options", "TicketStats", "build_server", "main", "stats"]

DB_NAME = "tickets.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'open'
);
CREATE TABLE IF NOT EXISTS comments (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ticket_id INTEGER NOT NULL, text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS keys (
    key TEXT PRIMARY KEY, tool TEXT NOT NULL, args_sha256 TEXT NOT NULL, output TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS fences (
    run_id TEXT PRIMARY KEY, lease_version INTEGER NOT NULL, state_version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_COUNTERS = (
    "effects",
    "calls",
    "refused_stale",
    "conflicts",
    "replays",
    "keys_beside_arguments",
    "keys_in_meta",
)


@dataclass(frozen=True)
class Options:
    """What one server offers (the command line's flags)."""

    state: Path
    fences: bool = False
    lookup: bool = False
    sep3182: bool = False
    idempotent: bool = False
    estimates: bool = False
    modern_only: bool = False


@dataclass(frozen=True)
class TicketStats:
    """The service's counters (see the module docstring)."""

    effects: int
    calls: int
    refused_stale: int
    conflicts: int
    replays: int
    keys_beside_arguments: int
    keys_in_meta: int


def stats(state: Path | str) -> TicketStats:
    """The counters of the service whose state is in ``state`` (zeros before any call)."""
    path = Path(state) / DB_NAME
    if not path.exists():
        return TicketStats(*(0 for _ in _COUNTERS))
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        found = dict(db.execute("SELECT name, value FROM counters").fetchall())
    finally:
        db.close()
    return TicketStats(*(int(found.get(name, 0)) for name in _COUNTERS))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class _Refused(Exception):  # noqa: N818 - a result to send, raised out of a transaction
    def __init__(self, kind: str, message: str, *, rpc: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.rpc = rpc


class TicketStore:
    """The SQLite state (one transaction per call: ``BEGIN IMMEDIATE``)."""

    def __init__(self, state: Path) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            state / DB_NAME, timeout=30, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.executescript(_SCHEMA)

    @contextmanager
    def txn(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def bump(self, name: str) -> None:
        self._db.execute(
            "INSERT INTO counters (name, value) VALUES (?, 1) "
            "ON CONFLICT (name) DO UPDATE SET value = value + 1",
            (name,),
        )

    def fence_ok(self, fence: Mapping[str, Any]) -> bool:
        """Record ``fence`` unless it is older than the run's highest (or from another
        store); inside a transaction."""
        epoch = fence.get("store_epoch")
        if epoch is not None:
            bound = self._db.execute("SELECT value FROM settings WHERE name = 'store_epoch'")
            row = bound.fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO settings (name, value) VALUES ('store_epoch', ?)", (epoch,)
                )
            elif row[0] != epoch:
                return False
        new = (fence["lease_version"], fence["state_version"])
        row = self._db.execute(
            "SELECT lease_version, state_version FROM fences WHERE run_id = ?",
            (fence["run_id"],),
        ).fetchone()
        if row is not None and new < tuple(row):
            return False
        if row is None or new > tuple(row):
            self._db.execute(
                "INSERT INTO fences (run_id, lease_version, state_version) VALUES (?, ?, ?) "
                "ON CONFLICT (run_id) DO UPDATE SET lease_version = excluded.lease_version, "
                "state_version = excluded.state_version",
                (fence["run_id"], *new),
            )
        return True

    def stored(self, key: str) -> tuple[str, str, Any] | None:
        row = self._db.execute(
            "SELECT tool, args_sha256, output FROM keys WHERE key = ?", (key,)
        ).fetchone()
        return None if row is None else (row[0], row[1], json.loads(row[2]))

    def remember(self, key: str, tool: str, args_sha256: str, output: Any) -> None:
        self._db.execute(
            "INSERT INTO keys (key, tool, args_sha256, output) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET tool = excluded.tool, "
            "args_sha256 = excluded.args_sha256, output = excluded.output",
            (key, tool, args_sha256, json.dumps(output, sort_keys=True)),
        )

    def create(self, title: str, body: str) -> dict[str, Any]:
        cursor = self._db.execute("INSERT INTO tickets (title, body) VALUES (?, ?)", (title, body))
        self.bump("effects")
        return {"ticket_id": int(cursor.lastrowid or 0), "title": title}

    def close(self, ticket_id: int) -> dict[str, Any] | None:
        cursor = self._db.execute("UPDATE tickets SET status = 'closed' WHERE id = ?", (ticket_id,))
        return {"ticket_id": ticket_id, "status": "closed"} if cursor.rowcount else None

    def comment(self, ticket_id: int, text: str) -> dict[str, Any] | None:
        if self._db.execute("SELECT 1 FROM tickets WHERE id = ?", (ticket_id,)).fetchone() is None:
            return None
        self._db.execute("INSERT INTO comments (ticket_id, text) VALUES (?, ?)", (ticket_id, text))
        return {"ticket_id": ticket_id, "commented": True}

    def tickets(self, query: str = "") -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, title, body, status FROM tickets WHERE instr(title, ?) > 0 ORDER BY id",
            (query,),
        ).fetchall()
        return [{"ticket_id": r[0], "title": r[1], "body": r[2], "status": r[3]} for r in rows]


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_READS = frozenset({"list_tickets", "tickets.search", "estimate_ticket"})
_TICKET_ID = {"type": "integer", "minimum": 1, "description": "the ticket's number"}


def _catalog(options: Options) -> list[types.Tool]:
    read = types.ToolAnnotations(read_only_hint=True)
    tools = [
        types.Tool(
            name="create_ticket",
            description="Open a ticket.",
            input_schema=_object(
                {
                    "title": {"type": "string", "minLength": 1, "maxLength": 200},
                    "body": {"type": "string", "maxLength": 10000},
                },
                ["title", "body"],
            ),
            annotations=types.ToolAnnotations(
                read_only_hint=False,
                destructive_hint=True,
                idempotent_hint=True if options.idempotent else None,
            ),
        ),
        types.Tool(
            name="list_tickets",
            description="List every ticket.",
            input_schema=_object({}, []),
            annotations=read,
        ),
        types.Tool(
            name="tickets.search",
            description="Tickets whose title contains the query.",
            input_schema=_object({"query": {"type": "string"}}, ["query"]),
            annotations=read,
        ),
        types.Tool(
            name="close_ticket",
            description="Close a ticket (it can be reopened).",
            input_schema=_object({"ticket_id": _TICKET_ID}, ["ticket_id"]),
            annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False),
        ),
        types.Tool(
            name="comment_ticket",
            description="Add a comment to a ticket.",
            input_schema=_object(
                {"ticket_id": _TICKET_ID, "text": {"type": "string", "minLength": 1}},
                ["ticket_id", "text"],
            ),
        ),
    ]
    if options.estimates:
        tools.append(
            types.Tool(
                name="estimate_ticket",
                description="Estimate a ticket's work in hours.",
                input_schema=_object(
                    {"ticket_id": _TICKET_ID, "hours": {"type": "number", "minimum": 0}},
                    ["ticket_id", "hours"],
                ),
                annotations=read,
            )
        )
    if options.fences:
        tools.append(
            types.Tool(
                name=RAISE_FENCE_TOOL,
                description="Record a new owner's fence; older fences are refused from now on.",
                input_schema=_object(
                    {
                        "run_id": {"type": "string", "minLength": 1},
                        "lease_version": {"type": "integer", "minimum": 0},
                        "state_version": {"type": "integer", "minimum": 0},
                        "store_epoch": {"type": ["string", "null"]},
                    },
                    ["run_id", "lease_version", "state_version"],
                ),
                annotations=types.ToolAnnotations(read_only_hint=False, destructive_hint=False),
            )
        )
    if options.lookup:
        tools.append(
            types.Tool(
                name=LOOKUP_TOOL,
                description="The stored output of a call made with an idempotency key.",
                input_schema=_object(
                    {"key": {"type": "string", "minLength": 1}, "tool": {"type": "string"}},
                    ["key"],
                ),
                annotations=read,
            )
        )
    return tools


def _result(output: Any) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(output, sort_keys=True))],
        structured_content=output,
    )


def _refusal(kind: str, message: str) -> types.CallToolResult:
    return types.CallToolResult.model_validate(
        {
            "content": [{"type": "text", "text": message}],
            "structuredContent": {META_ERROR: kind, "message": message},
            "isError": True,
            "_meta": {META_ERROR: kind},
        }
    )


def _failed(message: str) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)], is_error=True
    )


def _fence_of(meta: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    fence = (meta or {}).get(META_FENCE)
    if fence is None:
        return None
    ints = ("lease_version", "state_version")
    if (
        not isinstance(fence, Mapping)
        or not isinstance(fence.get("run_id"), str)
        or not all(type(fence.get(k)) is int for k in ints)
        or not isinstance(fence.get("store_epoch"), str | None)
    ):
        raise MCPError(types.INVALID_PARAMS, "a malformed ratchet/fence")
    return fence


async def _refuse_initialize(ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
    """``--modern-only``: the handshake is refused, naming the versions served."""
    if ctx.method == "initialize":
        requested = (ctx.params or {}).get("protocolVersion")
        raise MCPError(
            types.UNSUPPORTED_PROTOCOL_VERSION,
            "this server speaks the 2026-07-28 protocol only; initialize is not accepted",
            {"supported": list(MODERN_PROTOCOL_VERSIONS), "requested": requested},
        )
    return await call_next(ctx)


class _TicketsServer(Server[Any]):
    """The low-level server with the experimental capabilities this service offers."""

    def __init__(self, options: Options) -> None:
        super().__init__("tickets", version="1", on_list_tools=self._list_tools)
        self.options = options
        self.store = TicketStore(options.state)
        self._tools = {t.name: t for t in _catalog(options)}
        self._checkers = {
            name: validator_for(t.input_schema)(t.input_schema) for name, t in self._tools.items()
        }
        self.add_request_handler("tools/call", types.CallToolRequestParams, self._call)
        if options.modern_only:
            self.middleware.append(_refuse_initialize)

    def get_capabilities(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
        *,
        protocol_version: str | None = None,
    ) -> types.ServerCapabilities:
        experimental = dict(experimental_capabilities or {})
        if self.options.sep3182:
            experimental[SEP3182_CAPABILITY] = {}
        if self.options.fences or self.options.lookup:
            experimental[EXTENSION_CAPABILITY] = {
                "fences": self.options.fences,
                "lookup": self.options.lookup,
            }
        return super().get_capabilities(
            notification_options,
            experimental or None,
            extensions,
            protocol_version=protocol_version,
        )

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=list(self._tools.values()))

    async def _call(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        name, arguments = params.name, dict(params.arguments or {})
        if name not in self._tools:
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {name!r}")
        error = next(iter(self._checkers[name].iter_errors(arguments)), None)
        if error is not None:
            raise MCPError(types.INVALID_PARAMS, f"invalid arguments: {error.message}")
        raw = dict(ctx.params or {})
        meta = raw.get("_meta") if isinstance(raw.get("_meta"), Mapping) else None
        if name == LOOKUP_TOOL:
            return _result(self._lookup(arguments))
        try:
            if name == RAISE_FENCE_TOOL:
                return self._raise_fence(arguments)
            if name in _READS:
                return _result(self._read(name, arguments))
            return self._write(name, arguments, raw, meta)
        except _Refused as refused:
            if refused.rpc:
                raise MCPError(
                    types.INVALID_PARAMS, str(refused), data={META_ERROR: refused.kind}
                ) from None
            return _refusal(refused.kind, str(refused))

    def _lookup(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        with self.store.txn():
            found = self.store.stored(arguments["key"])
        if found is None or ("tool" in arguments and found[0] != arguments["tool"]):
            return {"found": False}
        return {"found": True, "output": found[2]}

    def _raise_fence(self, fence: Mapping[str, Any]) -> types.CallToolResult:
        checked = _fence_of({META_FENCE: {"store_epoch": None, **fence}})
        with self.store.txn():
            if checked is not None and not self.store.fence_ok(checked):
                self.store.bump("refused_stale")
                return _refusal(FENCE_REJECTED, "a newer fence was seen for this run")
        return _result({"raised": True})

    def _read(self, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        with self.store.txn():
            if name == "list_tickets":
                return {"tickets": self.store.tickets()}
            if name == "tickets.search":
                return {"tickets": self.store.tickets(arguments["query"])}
            return {"ticket_id": arguments["ticket_id"], "hours": arguments["hours"]}

    def _write(
        self,
        name: str,
        arguments: Mapping[str, Any],
        raw: Mapping[str, Any],
        meta: Mapping[str, Any] | None,
    ) -> types.CallToolResult:
        """Fence, key, effect and record: one transaction (a refusal commits too, so its
        counters stay)."""
        beside, in_meta = raw.get("idempotencyKey"), (meta or {}).get(META_IDEMPOTENCY_KEY)
        key = beside if isinstance(beside, str) else in_meta if isinstance(in_meta, str) else None
        fence = _fence_of(meta) if self.options.fences else None
        dedupes = self.options.sep3182 or self.options.idempotent
        args_sha256 = _digest(arguments)
        with self.store.txn():
            if name == "create_ticket":
                self.store.bump("calls")
            if key is not None:
                self.store.bump("keys_beside_arguments" if key == beside else "keys_in_meta")
            outcome = self._write_locked(name, arguments, key, fence, dedupes, args_sha256)
        if isinstance(outcome, _Refused):
            raise outcome
        return outcome

    def _write_locked(
        self,
        name: str,
        arguments: Mapping[str, Any],
        key: str | None,
        fence: Mapping[str, Any] | None,
        dedupes: bool,
        args_sha256: str,
    ) -> types.CallToolResult | _Refused:
        store = self.store
        if fence is not None and not store.fence_ok(fence):
            store.bump("refused_stale")
            return _Refused(FENCE_REJECTED, "a newer fence was seen for this run")
        if key is not None and dedupes and (stored := store.stored(key)) is not None:
            if stored[0] == name and stored[1] == args_sha256:
                store.bump("replays")
                return _result(stored[2])
            store.bump("conflicts")
            return _Refused(
                IDEMPOTENCY_CONFLICT,
                "this idempotency key was used with other arguments",
                rpc=self.options.sep3182,
            )
        output: dict[str, Any] | None
        if name == "create_ticket":
            output = store.create(arguments["title"], arguments["body"])
        elif name == "close_ticket":
            output = store.close(arguments["ticket_id"])
        else:
            output = store.comment(arguments["ticket_id"], arguments["text"])
        if output is None:
            return _failed(f"there is no ticket {arguments.get('ticket_id')}")
        if key is not None:
            store.remember(key, name, args_sha256, output)
        return _result(output)


def build_server(options: Options) -> Server[Any]:
    """The tickets server over ``options.state`` (not yet serving)."""
    return _TicketsServer(options)


_Asgi = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def _require_bearer(app: _Asgi, token: str) -> _Asgi:
    expected = f"Bearer {token}".encode()

    async def guarded(
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] == "http":
            sent = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(sent, expected):
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await app(scope, receive, send)

    return guarded


def _serve_http(server: Server[Any], host: str, port: int) -> None:
    app: Any = server.streamable_http_app(host=host)
    token = os.environ.get("TICKETS_TOKEN")
    if token:
        app = _require_bearer(app, token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    uvicorn.Server(config).run()


async def _serve_stdio(server: Server[Any]) -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m ratchet.testing.mcp_server")
    parser.add_argument("--state", type=Path, required=True, help="folder of the SQLite state")
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="the HTTP port (http only)")
    parser.add_argument("--fences", action="store_true", help="check fences (ratchet ext.)")
    parser.add_argument("--lookup", action="store_true", help="offer ratchet_lookup")
    parser.add_argument("--sep3182", action="store_true", help="advertise idempotencyKey")
    parser.add_argument("--idempotent", action="store_true", help="create_ticket dedupes")
    parser.add_argument("--estimates", action="store_true", help="offer estimate_ticket")
    parser.add_argument("--modern-only", action="store_true", help="refuse initialize")
    parser.add_argument("--pid-file", type=Path, help="write this process's id here")
    args = parser.parse_args(argv)
    if args.transport == "http" and not args.port:
        parser.error("--transport http needs --port")
    server = build_server(
        Options(
            state=args.state,
            fences=args.fences,
            lookup=args.lookup,
            sep3182=args.sep3182,
            idempotent=args.idempotent,
            estimates=args.estimates,
            modern_only=args.modern_only,
        )
    )
    if args.pid_file is not None:
        args.pid_file.write_text(str(os.getpid()))
    if args.transport == "http":
        _serve_http(server, args.host, args.port)
    else:
        anyio.run(_serve_stdio, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
