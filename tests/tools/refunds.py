"""A refunds service for the tool tests, and the tools that call it, one per recovery.

The service is a SQLite file (durable across "processes": every tool opens it anew), so a
test counts effects on the service's side, not the runtime's. It can dedupe by key (the
``idempotent`` tool sends an Idempotency-Key the service honours), answer lookups by key
(the ``lookup`` tool), check fences (the ``fenced`` tool), or do none of that (the
``review`` tool: every call is a new effect, nothing to ask afterwards).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ratchet.errors import AdapterError, FenceRejectedError
from ratchet.runtime import Action, Fence, Risk, RunEngine, derive_idempotency_key
from ratchet.runtime.catalog import ToolCatalog
from ratchet.tools import Tool, ToolCall, tool
from tests.adapters.harness import Harness


class RefundService:
    """The far side of the refund tools: refunds, calls and fences in one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._db() as db:
            db.executescript(
                "CREATE TABLE IF NOT EXISTS refunds (n INTEGER PRIMARY KEY AUTOINCREMENT, "
                "key TEXT, order_id TEXT, amount INTEGER);"
                "CREATE TABLE IF NOT EXISTS calls (n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT);"
                "CREATE TABLE IF NOT EXISTS fences "
                "(run_id TEXT PRIMARY KEY, lv INTEGER, sv INTEGER);"
                "CREATE TABLE IF NOT EXISTS refused (n INTEGER PRIMARY KEY AUTOINCREMENT);"
            )

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, isolation_level=None, timeout=30)

    def refund(self, key: str, order_id: str, amount: int, *, dedupe: bool) -> dict[str, Any]:
        with self._db() as db:
            db.execute("INSERT INTO calls (key) VALUES (?)", (key,))
            if dedupe:
                row = db.execute(
                    "SELECT n, order_id, amount FROM refunds WHERE key = ?", (key,)
                ).fetchone()
                if row is not None:
                    return {"refund_id": f"rf-{row[0]}", "order_id": row[1], "amount": row[2]}
            cur = db.execute(
                "INSERT INTO refunds (key, order_id, amount) VALUES (?, ?, ?)",
                (key, order_id, amount),
            )
            return {"refund_id": f"rf-{cur.lastrowid}", "order_id": order_id, "amount": amount}

    def find(self, key: str) -> dict[str, Any] | None:
        with self._db() as db:
            row = db.execute(
                "SELECT n, order_id, amount FROM refunds WHERE key = ? ORDER BY n LIMIT 1", (key,)
            ).fetchone()
        return (
            None
            if row is None
            else {"refund_id": f"rf-{row[0]}", "order_id": row[1], "amount": row[2]}
        )

    def check_fence(self, fence: Fence) -> None:
        """Refuse a fence older than the run's highest; record it otherwise."""
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute(
                "SELECT lv, sv FROM fences WHERE run_id = ?", (fence.run_id,)
            ).fetchone()
            if row is not None and fence.key() < (row[0], row[1]):
                db.execute("INSERT INTO refused DEFAULT VALUES")
                db.execute("COMMIT")
                raise FenceRejectedError(
                    "the refunds service has seen a newer fence", run_id=fence.run_id
                )
            db.execute(
                "INSERT INTO fences VALUES (?, ?, ?) ON CONFLICT (run_id) DO UPDATE "
                "SET lv = excluded.lv, sv = excluded.sv",
                (fence.run_id, fence.lease_version, fence.state_version),
            )
            db.execute("COMMIT")

    def count(self, table: str) -> int:
        with self._db() as db:
            return int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])

    @property
    def effects(self) -> int:
        return self.count("refunds")

    @property
    def calls(self) -> int:
        return self.count("calls")

    @property
    def refused(self) -> int:
        return self.count("refused")


class RefundArgs(BaseModel):
    order_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(ge=1, le=1_000_000)


def make_tool(service: RefundService, recovery: str) -> Tool:
    """The ``create_refund`` tool in the shape ``recovery`` names."""
    if recovery == "lookup":

        @tool(risk="irreversible_external_write")
        def create_refund(args: RefundArgs, call: ToolCall) -> dict[str, Any]:
            """Refund part of an order."""
            return service.refund(
                call.idempotency_key or "", args.order_id, args.amount_cents, dedupe=False
            )

        @create_refund.lookup
        def _find(key: str) -> dict[str, Any] | None:
            return service.find(key)

        return create_refund
    if recovery == "idempotent":

        @tool(risk="irreversible_external_write", idempotent=True)
        def create_refund(order_id: str, amount_cents: int, *, call: ToolCall) -> dict[str, Any]:
            """Refund part of an order (the service dedupes by Idempotency-Key)."""
            return service.refund(call.idempotency_key or "", order_id, amount_cents, dedupe=True)

        return create_refund
    if recovery == "review":

        @tool(risk="irreversible_external_write")
        def create_refund(args: RefundArgs, call: ToolCall) -> dict[str, Any]:
            """Refund part of an order (no dedupe, nothing to ask afterwards)."""
            return service.refund(
                call.idempotency_key or "", args.order_id, args.amount_cents, dedupe=False
            )

        return create_refund
    if recovery == "fenced":
        return FencedRefunds(service)
    raise ValueError(recovery)


class FencedRefunds(Tool):
    """The class form: a tool with state that checks fences at the service."""

    name = "create_refund"
    risk = Risk.IRREVERSIBLE_EXTERNAL_WRITE
    Args = RefundArgs

    def __init__(self, service: RefundService) -> None:
        self.service = service

    def run(self, args: RefundArgs, call: ToolCall) -> dict[str, Any]:
        if call.fence is None:
            raise AdapterError("a write needs a fence", retryable=False)
        self.service.check_fence(call.fence)
        return self.service.refund(
            call.idempotency_key or "", args.order_id, args.amount_cents, dedupe=True
        )

    def lookup(self, key: str) -> dict[str, Any] | None:
        return self.service.find(key)

    def raise_fence(self, fence: Fence) -> None:
        self.service.check_fence(fence)


@tool(risk="read_only")
def order_status(order_id: str) -> dict[str, str]:
    """Look an order up (read only)."""
    return {"order_id": order_id, "status": "delivered"}


@dataclass
class Crashes:
    """A ToolsAdapter hook that raises at a named stage of a call, once."""

    stage: str | None = None
    seen: list[str] = field(default_factory=list)

    def __call__(self, stage: str) -> None:
        self.seen.append(stage)
        if stage == self.stage:
            self.stage = None
            raise CrashInTool(stage)


class CrashInTool(Exception):
    """The worker died inside the tool adapter."""


def outputs(receipt_result: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(str(receipt_result["output"]))
    return loaded


def each(values: list[str]) -> Iterator[str]:
    yield from values


HookFactory = Callable[[], Callable[[str], None]]


@dataclass
class ToolRun(Harness):
    """The adapter harness with declared tools: the engine gets their contracts."""

    catalog: ToolCatalog = field(default_factory=ToolCatalog)

    def ports(self, adapter: Any, store: Any, probe: Any = None) -> dict[str, Any]:
        return {**super().ports(adapter, store, probe), "tools": self.catalog}

    def refund(
        self, engine: RunEngine, *, order_id: str = "o-1", amount: int = 500, key: str | None = None
    ) -> Action:
        return Action.model_validate(
            {
                "action_id": f"a-{engine.state.next_seq}",
                "kind": "create_refund",
                "risk": "irreversible_external_write",
                "args": {"order_id": order_id, "amount_cents": amount},
                "idempotency_key": key
                or derive_idempotency_key(engine.state.run_id, engine.state.plan_cursor),
                "expected_env_version": engine.state.environment.version,
                "deadline_at": self.clock.now() + 600,
            }
        )
