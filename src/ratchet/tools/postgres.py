"""A PostgreSQL tool that fences at the database: the storage-side check, in the same
transaction as the effect.

The ledger (:mod:`ratchet.tools.ledger`) refuses a stale owner before the tool is called,
but a worker that passed that check and then paused (a GC pause, SIGSTOP, a sleeping
laptop) can still reach the tool after a new owner took the run over. Only the storage
that is written can refuse that call for certain (Kleppmann's fencing token): here the
effect, the fence check and the idempotency record are one transaction, so the database
accepts the call's SQL exactly when it also accepts its fence and its key.

One call, one transaction (``BEGIN`` .. ``COMMIT``)::

    lock the run's row in <prefix>fences (inserted first if missing)   SELECT .. FOR UPDATE
    a store epoch other than the bound one?   refuse, count refused_epoch, COMMIT, raise
    a fence older than the stored one?        refuse, count refused_stale, COMMIT, raise
    the key in <prefix>idempotency?  same intent: its stored output, no effect
                                     other intent: IdempotencyConflictError (ROLLBACK)
    effect(cursor, args)                      the user's SQL
    insert the key row with the output, raise the fence to the call's, COMMIT

Because the effect is inside that transaction, every failure but a lost ``COMMIT`` reply
leaves no effect: the effect raising, a refused fence or key, a serialization failure or
deadlock, a connection lost before ``COMMIT``. A lost ``COMMIT`` reply is the one unknown,
and the key settles it: the key row exists exactly when the effect committed. So the
tool tries a call again itself (a bounded number of times, with a short back-off) after
contention or a lost connection: the next attempt either finds the key (the stored
output, no second effect) or runs the effect for the first time. When the attempts run
out, recovery asks :meth:`PostgresTool.lookup`, which reads the same row. The tool's
recovery is therefore ``lookup`` and it checks fences.

The effect must act only through the cursor it is given (no other connection, no call to
another service): it may be run more than once, each earlier attempt rolled back, and
what it does outside the transaction is not covered by any of the above.

Tables are created on first use (``CREATE TABLE IF NOT EXISTS`` under a transaction-level
advisory lock, so concurrent first calls do not race in the catalogue); their names are
``<prefix>fences`` and ``<prefix>idempotency``, in ``schema`` when one is given.

The connection string is kept private: it is in no ``repr``, error or log line (psycopg's
own messages can quote it, so they are never passed on; only the error's type and
SQLSTATE are).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import psycopg
from psycopg import IsolationLevel, sql
from psycopg.conninfo import conninfo_to_dict
from pydantic import BaseModel

from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    FenceRejectedError,
    IdempotencyConflictError,
)
from ratchet.runtime.actions import Risk
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.ports import Fence
from ratchet.tools.declare import Found, Tool, ToolCall

__all__ = ["Effect", "FenceRow", "PostgresTool"]

log = logging.getLogger(__name__)

#: ``effect(cursor, args)`` (optionally ``call=`` as well): run SQL, return the output.
Effect = Callable[..., Any]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,40}$")
# One advisory lock id for every tool's table creation (a constant, so two processes
# creating the same tables serialise on it).
_DDL_LOCK = int.from_bytes(
    hashlib.sha256(b"ratchet/tools/postgres/ddl").digest()[:8], "big", signed=True
)
_DEFAULT_RETRIES = 5
# serialization_failure, deadlock_detected: the transaction was rolled back whole, and the
# same transaction again may well pass.
_CONTENTION = frozenset({"40001", "40P01"})


@dataclass(frozen=True, slots=True)
class FenceRow:
    """One run's row of the fence table: the highest fence accepted, the store epoch bound
    to the run (None: none yet) and the refusals counted."""

    run_id: str
    lease_version: int
    state_version: int
    store_epoch: str | None
    refused_stale: int
    refused_epoch: int


def _sqlstate(exc: BaseException) -> str:
    return str(getattr(exc, "sqlstate", "") or "")


def _describe(conninfo: str) -> str:
    """``user@host:port/dbname`` (never the password).

    Raises:
        ConfigurationError: the connection string does not parse (it is not quoted: it
            may hold a password).
    """
    try:
        parts = conninfo_to_dict(conninfo)
    except psycopg.Error:
        raise ConfigurationError(
            "the PostgreSQL connection string does not parse", field="dsn"
        ) from None
    host = str(parts.get("host") or parts.get("hostaddr") or "local")
    port = str(parts.get("port") or "5432")
    user = str(parts.get("user") or "")
    dbname = str(parts.get("dbname") or user)
    return f"{user + '@' if user else ''}{host}:{port}/{dbname}"


class _Connections:
    """A few idle connections kept for reuse, handed out one caller at a time (thread
    safe). A connection that is broken or left inside a transaction is closed, never
    reused. (psycopg_pool does more; it is not a dependency, and a tool needs only this.)"""

    def __init__(self, conninfo: str, *, connect_timeout: int, max_idle: int) -> None:
        self._conninfo = conninfo
        self._timeout = connect_timeout
        self._max_idle = max_idle
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"_Connections(idle={len(self._idle)})"

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(self._conninfo, connect_timeout=self._timeout, autocommit=True)
        except psycopg.Error as exc:
            log.warning("postgres connect failed: %s", type(exc).__name__)
            raise AdapterError(
                "the database cannot be reached",
                retryable=True,
                error=type(exc).__name__,
                sqlstate=_sqlstate(exc),
            ) from None

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None or conn.closed:
            conn = self._connect()
        try:
            yield conn
        finally:
            healthy = (
                not conn.closed
                and not conn.broken
                and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            )
            with self._lock:
                keep = healthy and len(self._idle) < self._max_idle
                if keep:
                    self._idle.append(conn)
            if not keep:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class PostgresTool(Tool):
    """A tool whose effect is SQL in one fenced, idempotent transaction (see the module
    docstring). Subclass it (set ``name``, ``Args``, define :meth:`effect`) or construct
    it with ``name=``, ``args=`` and ``effect=``::

        class RefundArgs(BaseModel):
            order_id: str
            amount_cents: int

        def create_refund(cur, args):
            cur.execute("INSERT INTO refunds (order_id, amount_cents) VALUES (%s, %s) "
                        "RETURNING id", (args.order_id, args.amount_cents))
            return {"refund_id": cur.fetchone()[0]}

        refunds = PostgresTool("postgresql://app@db/shop", name="create_refund",
                               args=RefundArgs, effect=create_refund)

    ``dsn`` is a libpq connection string or URI; ``schema`` and ``prefix`` name the
    tables (``<prefix>fences``, ``<prefix>idempotency``); ``isolation`` is the effect's
    transaction isolation level; ``retries`` bounds the attempts in all (another after
    a serialization failure, a deadlock, a race to a key or a lost connection). A
    read-only tool (``risk="read_only"``) runs its effect in a
    ``READ ONLY`` transaction with no fence and no key.

    Raises (constructor):
        ConfigurationError: a connection string that does not parse, a bad schema or
            prefix, no effect, a bad retry count, or a bad declaration (name, risk, Args).
    """

    name: ClassVar[str] = ""
    risk: ClassVar[Risk | str] = Risk.IRREVERSIBLE_EXTERNAL_WRITE

    def __init__(
        self,
        dsn: str,
        *,
        effect: Effect | None = None,
        name: str | None = None,
        args: type[BaseModel] | None = None,
        risk: Risk | str | None = None,
        description: str | None = None,
        requires_approval: bool | None = None,
        schema: str | None = None,
        prefix: str = "ratchet_",
        isolation: IsolationLevel = IsolationLevel.READ_COMMITTED,
        retries: int = _DEFAULT_RETRIES,
        connect_timeout: int = 10,
        max_idle: int = 4,
    ) -> None:
        self.declare(
            name=name,
            Args=args,
            risk=risk,
            description=description,
            requires_approval=requires_approval,
        )
        if effect is not None:
            self._effect_fn: Effect | None = effect
        elif type(self).effect is not PostgresTool.effect:
            self._effect_fn = None
        else:
            raise ConfigurationError(
                f"tool {self.name!r}: a PostgresTool needs an effect (effect= or a subclass "
                "that defines effect)",
                field="effect",
            )
        for value, what in ((schema, "schema"), (prefix, "prefix")):
            if value is not None and not _IDENT.match(value):
                raise ConfigurationError(
                    f"{what} {value!r} must match {_IDENT.pattern}", field=what
                )
        if retries < 1:
            raise ConfigurationError("retries must be at least 1", field="retries")
        self._where = _describe(dsn)
        self._schema = schema
        self._prefix = prefix
        self._isolation = isolation
        self._retries = retries
        self._pool = _Connections(dsn, connect_timeout=connect_timeout, max_idle=max_idle)
        self._ready = False
        self._ready_lock = threading.Lock()
        effect_fn = self._effect_fn if self._effect_fn is not None else self.effect
        self._effect_wants_call = "call" in inspect.signature(effect_fn).parameters
        self.spec  # noqa: B018 - declaration errors surface here, not at the first call

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, database={self._where!r})"

    def close(self) -> None:
        self._pool.close()

    # -- what users define ---------------------------------------------------------------

    def effect(self, cursor: psycopg.Cursor[Any], args: Any) -> Any:
        """Run the call's SQL through ``cursor`` (inside the call's transaction) and
        return its output: a JSON value (no floats) or a pydantic model. Raise
        AdapterError(retryable=False) to refuse; the transaction then rolls back.
        Connections are reused: change session settings with ``SET LOCAL`` only."""
        raise NotImplementedError

    # -- table names ---------------------------------------------------------------------

    def _table(self, suffix: str) -> sql.Identifier:
        name = f"{self._prefix}{suffix}"
        return sql.Identifier(self._schema, name) if self._schema else sql.Identifier(name)

    def _qualified(self, suffix: str) -> str:
        name = f"{self._prefix}{suffix}"
        return f"{self._schema}.{name}" if self._schema else name

    @property
    def fence_table(self) -> str:
        """The fence table's name (schema-qualified when a schema is set)."""
        return self._qualified("fences")

    @property
    def idempotency_table(self) -> str:
        """The idempotency table's name (schema-qualified when a schema is set)."""
        return self._qualified("idempotency")

    # -- tool protocol -------------------------------------------------------------------

    def run(self, args: Any, call: ToolCall) -> Any:
        """One fenced, idempotent transaction (the module docstring's steps).

        Raises:
            FenceRejectedError: the database holds a newer fence for the run, or another
                store epoch (``reason="store_epoch"``); the refusal is counted in the fence
                table and nothing else was written.
            IdempotencyConflictError: the key is stored with another intent or tool.
            AdapterError: retryable=False: the effect refused or failed, or its output is
                not canonical JSON (rolled back: no effect); retryable=True: the database
                could not be reached, or the attempts ran out (after a lost ``COMMIT``
                reply, :meth:`lookup` says whether it committed).
        """
        if not self.spec.is_write:
            return self._attempts(lambda conn: self._read(conn, args))
        if call.fence is None or not call.idempotency_key or not call.intent_digest:
            raise AdapterError(
                f"tool {self.name} writes only with a fence, a key and an intent digest",
                retryable=False,
                tool=self.name,
            )
        fence, key, intent = call.fence, call.idempotency_key, call.intent_digest
        return self._attempts(lambda conn: self._write(conn, args, call, fence, key, intent))

    def lookup(self, key: str) -> Any | None:
        """The stored output of this tool's committed call with ``key``, with the intent it
        was made for, or None: no call with that key committed (and none will: a later one
        is a new call).

        Raises:
            AdapterError: the database cannot be read (retryable=True).
        """
        query = sql.SQL(
            "SELECT output, intent_digest FROM {} WHERE idempotency_key = %s AND tool = %s"
        ).format(self._table("idempotency"))
        row = self._attempts(lambda conn: conn.execute(query, (key, self.name)).fetchone())
        return None if row is None else Found(json.loads(row[0]), intent_digest=row[1])

    def raise_fence(self, fence: Fence) -> None:
        """Record ``fence`` as the run's highest at the database (nothing else written).

        Raises:
            FenceRejectedError: the database holds a newer fence or another store epoch
                for the run (the refusal is counted).
            AdapterError: the database cannot be reached (retryable=True).
        """

        def attempt(conn: psycopg.Connection[Any]) -> None:
            with conn.transaction():
                cur = conn.cursor()
                refusal = self._check_fence(cur, fence)
                if refusal is None:
                    self._store_fence(cur, fence)
            # A refusal leaves the block normally, so its count commits; then it is raised.
            if refusal is not None:
                raise refusal

        self._attempts(attempt)

    def fence_row(self, run_id: str) -> FenceRow | None:
        """The run's fence row (for operators and tests), or None.

        Raises:
            AdapterError: the database cannot be read (retryable=True).
        """
        query = sql.SQL(
            "SELECT run_id, lease_version, state_version, store_epoch, refused_stale, "
            "refused_epoch FROM {} WHERE run_id = %s"
        ).format(self._table("fences"))
        row = self._attempts(lambda conn: conn.execute(query, (run_id,)).fetchone())
        if row is None:
            return None
        return FenceRow(row[0], int(row[1]), int(row[2]), row[3], int(row[4]), int(row[5]))

    # -- the transaction -----------------------------------------------------------------

    def _attempts(
        self, attempt: Callable[[psycopg.Connection[Any]], Any], *, tables: bool = True
    ) -> Any:
        """Run ``attempt`` on a connection, again (at most ``retries`` times in all, with a
        short jittered back-off) when it rolled back for contention, lost a race to a key,
        or lost its connection.

        Running it again is safe: each attempt is one transaction, and a write's attempt
        first looks its key up, so after a ``COMMIT`` whose reply was lost the next
        attempt finds the key and returns the stored output instead of a second effect.

        Raises:
            AdapterError: see :meth:`_translate`; retryable=True when the attempts ran
                out, or the database cannot be reached (connecting is not retried here).
        """
        if tables:
            self._ensure_tables()
        reason = "contention"
        for n in range(self._retries):
            if n:
                time.sleep(min(0.2, 0.01 * (2**n)) * (0.5 + random.random()))  # noqa: S311
            with self._pool.connection() as conn:
                try:
                    conn.isolation_level = self._isolation
                    return attempt(conn)
                except AdapterError:
                    raise
                except psycopg.Error as exc:
                    again = self._again(exc, conn)
                    if again is None:
                        raise self._translate(exc) from None
                    reason = again
        if reason == "connection":
            raise AdapterError(
                f"tool {self.name}: the database connection kept failing "
                f"({self._retries} attempts); whether a transaction committed is for lookup "
                "to say",
                retryable=True,
                tool=self.name,
            )
        raise AdapterError(
            f"tool {self.name}: the transaction kept failing to serialise "
            f"({self._retries} attempts, each rolled back)",
            retryable=True,
            tool=self.name,
        )

    def _again(self, exc: psycopg.Error, conn: psycopg.Connection[Any]) -> str | None:
        """Why the attempt may run again (None: it may not)."""
        if _sqlstate(exc) in _CONTENTION:
            return "contention"
        if (
            isinstance(exc, psycopg.errors.UniqueViolation)
            and exc.diag.table_name == f"{self._prefix}idempotency"
        ):
            # Two runs raced to one key: the loser rolled back, and its next attempt
            # finds the winner's row (same intent: the output; other intent: a conflict).
            return "key"
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and (
            conn.broken or conn.closed
        ):
            log.warning("tool %s: database connection lost: %s", self.name, type(exc).__name__)
            return "connection"
        return None

    def _translate(self, exc: psycopg.Error) -> AdapterError:
        """A psycopg error that does not warrant another attempt, as ratchet's: the
        transaction rolled back, so there was no effect. An operational failure (a
        statement timeout, the server short of resources) is retryable=True; anything
        else the database refused (the effect's SQL) is a refusal, retryable=False."""
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            log.warning("tool %s: database failure: %s", self.name, type(exc).__name__)
            return AdapterError(
                f"tool {self.name}: the database failed the transaction "
                f"({type(exc).__name__}); it was rolled back",
                retryable=True,
                tool=self.name,
                error=type(exc).__name__,
                sqlstate=_sqlstate(exc),
            )
        return self._refusal(exc)

    def _refusal(self, exc: BaseException) -> AdapterError:
        return AdapterError(
            f"tool {self.name}: the effect failed and was rolled back ({type(exc).__name__})",
            retryable=False,
            tool=self.name,
            error=type(exc).__name__,
            sqlstate=_sqlstate(exc),
        )

    def _write(
        self,
        conn: psycopg.Connection[Any],
        args: Any,
        call: ToolCall,
        fence: Fence,
        key: str,
        intent: str,
    ) -> Any:
        with conn.transaction():
            cur = conn.cursor()
            # 1-2. the run's fence row, locked until COMMIT: a new owner's raise_fence waits
            # here for this call, and this call waits for it.
            refusal = self._check_fence(cur, fence)
            if refusal is None:
                return json.loads(self._fenced_write(cur, args, call, fence, key, intent))
        # A refusal leaves the block normally, so its count commits; then it is raised.
        raise refusal

    def _fenced_write(
        self,
        cur: psycopg.Cursor[Any],
        args: Any,
        call: ToolCall,
        fence: Fence,
        key: str,
        intent: str,
    ) -> str:
        """Steps 3-5, the fence row locked and the fence accepted: the output's text."""
        # 3. the key: a committed call with it is the answer (no effect).
        found = cur.execute(
            sql.SQL("SELECT tool, intent_digest, output FROM {} WHERE idempotency_key = %s").format(
                self._table("idempotency")
            ),
            (key,),
        ).fetchone()
        if found is not None:
            if found[0] != self.name or found[1] != intent:
                raise IdempotencyConflictError(
                    "key was used for another intent",
                    idempotency_key=key,
                    tool=self.name,
                    source="postgres",
                )
            self._store_fence(cur, fence)
            return str(found[2])
        # 4. the effect, inside this transaction.
        text = self._run_effect(cur, args, call)
        # 5. its key and output, and the fence raised, in the same COMMIT.
        cur.execute(
            sql.SQL(
                "INSERT INTO {} (idempotency_key, tool, intent_digest, output, run_id, "
                "lease_version, state_version) VALUES (%s, %s, %s, %s, %s, %s, %s)"
            ).format(self._table("idempotency")),
            (key, self.name, intent, text, fence.run_id, fence.lease_version, fence.state_version),
        )
        self._store_fence(cur, fence)
        return text

    def _read(self, conn: psycopg.Connection[Any], args: Any) -> Any:
        with conn.transaction():
            cur = conn.cursor()
            cur.execute("SET TRANSACTION READ ONLY")
            call = ToolCall(run_id="", tool=self.name, idempotency_key=None, fence=None)
            text = self._run_effect(cur, args, call)
        return json.loads(text)

    def _run_effect(self, cur: psycopg.Cursor[Any], args: Any, call: ToolCall) -> str:
        """The effect's output as canonical JSON text. A failure raises inside the
        transaction, so it rolls back: no effect."""
        effect_fn = self._effect_fn if self._effect_fn is not None else self.effect
        extra = {"call": call} if self._effect_wants_call else {}
        try:
            output = effect_fn(cur, args, **extra)
        except (AdapterError, psycopg.Error):
            raise
        except Exception as exc:
            # Only the type: a message may quote the data (or a secret).
            raise self._refusal(exc) from None
        plain = output.model_dump(mode="json") if isinstance(output, BaseModel) else output
        try:
            return canonical_json(plain).decode()
        except Exception as exc:  # ContractError, TypeError: not JSON we can store
            raise AdapterError(
                f"tool {self.name}: the effect's output is not canonical JSON "
                f"({type(exc).__name__}); rolled back",
                retryable=False,
                tool=self.name,
            ) from None

    def _check_fence(self, cur: psycopg.Cursor[Any], fence: Fence) -> FenceRejectedError | None:
        """Lock the run's fence row; the refusal of ``fence`` if it is older than the
        stored one or of another store epoch (counted; the caller commits the count, then
        raises it), else None."""
        table = self._table("fences")
        cur.execute(
            sql.SQL(
                "INSERT INTO {} (run_id, lease_version, state_version) VALUES (%s, 0, 0) "
                "ON CONFLICT (run_id) DO NOTHING"
            ).format(table),
            (fence.run_id,),
        )
        row = cur.execute(
            sql.SQL(
                "SELECT lease_version, state_version, store_epoch FROM {} "
                "WHERE run_id = %s FOR UPDATE"
            ).format(table),
            (fence.run_id,),
        ).fetchone()
        if row is None:  # the row was inserted or present above, and is locked now
            raise AdapterError("the fence row vanished", retryable=True, run_id=fence.run_id)
        seen = (int(row[0]), int(row[1]))
        bound: str | None = row[2]
        if fence.store_epoch is not None and bound is not None and bound != fence.store_epoch:
            self._count(cur, fence.run_id, "refused_epoch")
            return FenceRejectedError(
                "the database serves this run for another store (its epoch differs)",
                run_id=fence.run_id,
                reason="store_epoch",
                bound_epoch=bound,
                fence_epoch=fence.store_epoch,
                source="postgres",
                table=self.fence_table,
            )
        if fence.key() < seen:
            self._count(cur, fence.run_id, "refused_stale")
            return FenceRejectedError(
                "the database has seen a newer fence for this run",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=seen,
                source="postgres",
                table=self.fence_table,
            )
        return None

    def _count(self, cur: psycopg.Cursor[Any], run_id: str, column: str) -> None:
        # Counted in the refusing transaction, which commits it and nothing else.
        cur.execute(
            sql.SQL("UPDATE {} SET {} = {} + 1, updated_at = now() WHERE run_id = %s").format(
                self._table("fences"), sql.Identifier(column), sql.Identifier(column)
            ),
            (run_id,),
        )

    def _store_fence(self, cur: psycopg.Cursor[Any], fence: Fence) -> None:
        """Raise the locked row to ``fence`` (checked not older) and bind its epoch."""
        cur.execute(
            sql.SQL(
                "UPDATE {} SET lease_version = %s, state_version = %s, "
                "store_epoch = COALESCE(store_epoch, %s), updated_at = now() WHERE run_id = %s"
            ).format(self._table("fences")),
            (fence.lease_version, fence.state_version, fence.store_epoch, fence.run_id),
        )

    # -- tables --------------------------------------------------------------------------

    def _ensure_tables(self) -> None:
        """Create the schema and tables if missing, once per tool (thread safe).

        Raises:
            AdapterError: the database cannot be reached (retryable=True) or refuses the
                DDL (retryable=False: a missing privilege, say).
        """
        if self._ready:
            return
        with self._ready_lock:
            if not self._ready:
                self._attempts(self._create_tables, tables=False)
                self._ready = True

    def _create_tables(self, conn: psycopg.Connection[Any]) -> None:
        fences, idem = self._qualified("fences"), self._qualified("idempotency")
        present = conn.execute("SELECT to_regclass(%s), to_regclass(%s)", (fences, idem))
        row = present.fetchone()
        if row is not None and row[0] is not None and row[1] is not None:
            return  # nothing to create: no privilege needed, no lock taken
        with conn.transaction():
            # Concurrent CREATE ... IF NOT EXISTS can still collide in the catalogue; the
            # lock (released at COMMIT) makes creators take turns.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_DDL_LOCK,))
            if self._schema:
                conn.execute(
                    sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self._schema))
                )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} ("
                    "run_id text PRIMARY KEY, "
                    "lease_version bigint NOT NULL, "
                    "state_version bigint NOT NULL, "
                    "store_epoch text, "
                    "refused_stale bigint NOT NULL DEFAULT 0, "
                    "refused_epoch bigint NOT NULL DEFAULT 0, "
                    "updated_at timestamptz NOT NULL DEFAULT now())"
                ).format(self._table("fences"))
            )
            # The output is canonical JSON as text, not jsonb: jsonb would reorder keys
            # and refuses \u0000, and the receipt's digest is over these exact bytes.
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} ("
                    "idempotency_key text PRIMARY KEY, "
                    "tool text NOT NULL, "
                    "intent_digest text NOT NULL, "
                    "output text NOT NULL, "
                    "run_id text NOT NULL, "
                    "lease_version bigint NOT NULL, "
                    "state_version bigint NOT NULL, "
                    "committed_at timestamptz NOT NULL DEFAULT now())"
                ).format(self._table("idempotency"))
            )
