"""A small reference HTTP service (an orders API) that behaves like well-known idempotent
APIs. Tests and chaos drills run it on a loopback port; its state lives in SQLite, so it
survives restarts.

Routes (JSON bodies)::

    GET  /v1/identity          {"service_id", "namespace", "revision"}
    POST /v1/fences            {"run_id", "lease_version", "state_version"} -> 200 | 412
    POST /v1/orders            the order; headers below -> 201 | 200 | 400 | 409 | 412 | 422
    GET  /v1/receipts/<key>    200 receipt | 404 | 409 (in flight)
    GET  /v1/stats             {"effects", "refused_stale", "revision"}

``POST /v1/orders`` headers: ``Idempotency-Key``; the fence ``Ratchet-Run-Id``,
``Ratchet-Lease-Version``, ``Ratchet-State-Version``; ``Ratchet-Intent-Digest``; and
``Ratchet-Approval-Digest`` when the write was approved. Behaviour:

* same key, same body: the stored receipt again (200, ``Idempotent-Replayed: true``);
* same key, other body: 422 with the existing receipt;
* same key while the first request is still in flight: 409;
* a fence lower than the highest seen for the run: 412, also when it arrives after the
  newer one, and also when a newer fence arrived while the request was in flight (the
  fence is checked again in the transaction that commits the order);
* receipts bind the approval digest and the service's commit time.

One process serves one database: on start-up, requests left "in flight" by a previous
process are forgotten (their order was never committed: the order, the receipt and the
revision are written in one transaction).

It is a **reference implementation of the adapter contract**, for tests, drills and as a
model for a real service; run it on loopback. Still, it is safe to run as documented:
every connection has a read timeout (a client that sends its body slowly, or never, is
dropped), at most ``max_connections`` requests are served at once (the rest get 503 at
once, no thread is started for them), and with a ``token`` every mutating route
(``POST /v1/fences``, ``POST /v1/orders``) needs ``Authorization: Bearer <token>``
(401 otherwise, nothing recorded), so nobody else can raise a run's fence to block its
orders. :class:`ratchet.adapters.HttpAdapter` sends the token it is given.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import socket
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote

from pydantic import TypeAdapter, ValidationError

from ratchet.errors import ContractError
from ratchet.runtime.canonical import canonical_json, strict_json_loads
from ratchet.runtime.ports import Fence
from ratchet.runtime.types import Identifier

__all__ = ["DropConnection", "OrdersService", "RunningService", "ServiceHook", "main", "serve"]

ServiceHook = Callable[[str, str], None]
"""Called with ``(stage, idempotency_key)`` at ``"in_flight"`` (the request is marked,
the order not yet committed) and ``"committed"`` (before the response is sent)."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS fences (run_id TEXT PRIMARY KEY, lease_version INTEGER "
    "NOT NULL, state_version INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS requests (idempotency_key TEXT PRIMARY KEY, request_digest "
    "TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN ('in_flight', 'done')), "
    "receipt TEXT)",
    "CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, idempotency_key TEXT "
    "NOT NULL UNIQUE, body TEXT NOT NULL, created_at INTEGER NOT NULL)",
)
_MAX_BODY = 1 << 16

Reply = tuple[int, dict[str, Any]]


class DropConnection(Exception):  # noqa: N818 - it is an instruction, not an error
    """Raised by a hook: close the connection without a response (a lost reply)."""


def _no_hook(stage: str, key: str) -> None:
    return None


class OrdersService:
    """The orders API's logic over one SQLite database (no HTTP here).

    Raises (constructor):
        sqlite3.Error: the database cannot be opened.
    """

    def __init__(
        self,
        db_path: str | Path,
        *,
        namespace: str = "orders-api",
        clock: Callable[[], int] | None = None,
        hook: ServiceHook | None = None,
        busy_timeout_s: float = 30.0,
    ) -> None:
        self.db_path = Path(db_path)
        self.busy_timeout_s = busy_timeout_s
        self.namespace = namespace
        self.clock = clock or (lambda: int(time.time()))
        self.hook = hook or _no_hook
        with self._txn() as db:
            for statement in _SCHEMA:
                db.execute(statement)
            if self._meta(db, "service_id") is None:
                self._set(db, "service_id", "orders-" + uuid.uuid4().hex)
                for name in ("revision", "refused_stale", "seq"):
                    self._set(db, name, "0")
            db.execute("DELETE FROM requests WHERE status = 'in_flight'")

    def __repr__(self) -> str:
        return f"OrdersService(db_path={str(self.db_path)!r})"

    @contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.db_path, timeout=self.busy_timeout_s, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    @staticmethod
    def _meta(db: sqlite3.Connection, key: str) -> str | None:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    @staticmethod
    def _set(db: sqlite3.Connection, key: str, value: str) -> None:
        db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) "
            "DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def _bump(self, db: sqlite3.Connection, key: str) -> int:
        value = int(self._meta(db, key) or "0") + 1
        self._set(db, key, str(value))
        return value

    @staticmethod
    def _fence_ok(db: sqlite3.Connection, fence: Fence) -> tuple[bool, list[int]]:
        row = db.execute(
            "SELECT lease_version, state_version FROM fences WHERE run_id = ?", (fence.run_id,)
        ).fetchone()
        seen = [int(row[0]), int(row[1])] if row is not None else [0, 0]
        return (row is None or fence.key() >= (seen[0], seen[1])), seen

    def _epoch_ok(self, db: sqlite3.Connection, fence: Fence) -> bool:
        """The service serves one store: it binds the first epoch a fence carries and
        refuses every other (counted as ``refused_epoch``)."""
        if fence.store_epoch is None:
            return True
        bound = self._meta(db, "store_epoch")
        if bound is None:
            self._set(db, "store_epoch", fence.store_epoch)
            return True
        if bound == fence.store_epoch:
            return True
        self._bump(db, "refused_epoch")
        return False

    def _record_fence(self, db: sqlite3.Connection, fence: Fence) -> tuple[bool, list[int]]:
        if not self._epoch_ok(db, fence):
            return False, [-1, -1]
        ok, seen = self._fence_ok(db, fence)
        if not ok:
            self._bump(db, "refused_stale")
            return False, seen
        db.execute(
            "INSERT INTO fences VALUES (?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET "
            "lease_version = excluded.lease_version, "
            "state_version = excluded.state_version",
            (fence.run_id, fence.lease_version, fence.state_version),
        )
        return True, seen

    # -- operations ----------------------------------------------------------------------------

    def identity(self) -> Reply:
        with self._txn() as db:
            return 200, {
                "service_id": self._meta(db, "service_id"),
                "namespace": self.namespace,
                "revision": int(self._meta(db, "revision") or "0"),
            }

    def stats(self) -> Reply:
        with self._txn() as db:
            effects = db.execute("SELECT count(*) FROM orders").fetchone()[0]
            return 200, {
                "effects": int(effects),
                "refused_stale": int(self._meta(db, "refused_stale") or "0"),
                "revision": int(self._meta(db, "revision") or "0"),
            }

    def raise_fence(self, fence: Fence) -> Reply:
        with self._txn() as db:
            ok, seen = self._record_fence(db, fence)
        if not ok:
            return 412, {"error": "stale_fence", "seen": seen}
        return 200, {"accepted": True}

    def receipt(self, key: str) -> Reply:
        with self._txn() as db:
            row = db.execute(
                "SELECT status, receipt FROM requests WHERE idempotency_key = ?", (key,)
            ).fetchone()
        if row is None:
            return 404, {"error": "not_found"}
        if row[0] == "in_flight":
            return 409, {"error": "in_flight"}
        return 200, strict_json_loads(row[1])

    def place_order(
        self, key: str, fence: Fence, intent_digest: str, approval_digest: str | None, body: bytes
    ) -> Reply:
        """Place one order under an idempotency key and a fence (see the module docstring).

        Raises:
            DropConnection: from the hook (tests and drills only).
        """
        request_digest = hashlib.sha256(b"/v1/orders\x00" + body).hexdigest()
        with self._txn() as db:
            ok, seen = self._record_fence(db, fence)
            if not ok:
                return 412, {"error": "stale_fence", "seen": seen}
            row = db.execute(
                "SELECT request_digest, status, receipt FROM requests WHERE idempotency_key = ?",
                (key,),
            ).fetchone()
            if row is not None and row[1] == "in_flight":
                return 409, {"error": "in_flight"}
            if row is not None:
                stored = strict_json_loads(row[2])
                if row[0] != request_digest:
                    return 422, {"error": "idempotency_key_reused", "receipt": stored}
                return 200, stored
            db.execute(
                "INSERT INTO requests VALUES (?, ?, 'in_flight', NULL)", (key, request_digest)
            )
        self.hook("in_flight", key)
        with self._txn() as db:
            # Checked again: a new owner may have raised the fence while we were in flight.
            ok, seen = self._fence_ok(db, fence)
            if not ok:
                self._bump(db, "refused_stale")
                db.execute("DELETE FROM requests WHERE idempotency_key = ?", (key,))
                return 412, {"error": "stale_fence", "seen": seen}
            revision = self._bump(db, "revision")
            order_id = f"ord-{self._bump(db, 'seq')}"
            now = self.clock()
            db.execute(
                "INSERT INTO orders VALUES (?, ?, ?, ?)", (order_id, key, body.decode(), now)
            )
            receipt = {
                "namespace": self.namespace,
                "receipt_version": 1,
                "receipt_id": order_id,
                "idempotency_key": key,
                "intent_digest": intent_digest,
                "result": {"order_id": order_id, "status": "placed"},
                "committed_at": now,
                "env_version_after": revision,
                "approval_digest": approval_digest,
            }
            db.execute(
                "UPDATE requests SET status = 'done', receipt = ? WHERE idempotency_key = ?",
                (canonical_json(receipt).decode(), key),
            )
        self.hook("committed", key)
        return 201, receipt


_IDENTIFIER: TypeAdapter[str] = TypeAdapter(Identifier)


def _identifier(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return _IDENTIFIER.validate_python(value)
    except ValidationError:
        return None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # A reply's headers and body leave in separate writes: without TCP_NODELAY, Nagle's
    # algorithm holds the body back until the client's delayed ACK of the headers (about
    # 40 ms) on a kept-alive connection.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        # Every read on this connection times out: a slow or silent client is dropped.
        self.connection.settimeout(getattr(self.server, "read_timeout_s", 10.0))

    def _authorised(self) -> bool:
        token = getattr(self.server, "token", None)
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return True
        self.close_connection = True
        self._reply(401, {"error": "unauthorised"})
        return False

    def log_message(self, format: str, *args: Any) -> None:
        return None  # quiet: tests and drills read the stats route instead

    def _reply(
        self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = canonical_json(payload)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if length < 0 or length > _MAX_BODY:
            return None
        return self.rfile.read(length)

    def _guarded(self, serve: Callable[[], None]) -> None:
        """Serve one request; the service's database failing under it (locked past its
        busy timeout, its disk full) is a 503, the transaction rolled back, so a client
        retries or looks the order up, never guesses."""
        try:
            serve()
        except sqlite3.Error:
            self.close_connection = True
            self._reply(503, {"error": "store_unavailable"})

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _get(self) -> None:
        service = self.server.service
        if self.path == "/v1/identity":
            self._reply(*service.identity())
        elif self.path == "/v1/stats":
            self._reply(*service.stats())
        elif self.path.startswith("/v1/receipts/"):
            key = _identifier(unquote(self.path[len("/v1/receipts/") :]))
            if key is None:
                self._reply(400, {"error": "bad_key"})
            else:
                self._reply(*service.receipt(key))
        else:
            self._reply(404, {"error": "no_route"})

    def _fence(self, data: dict[str, Any] | None = None) -> Fence | None:
        try:
            if data is not None:
                return Fence.model_validate(data)
            return Fence(
                run_id=self.headers.get("Ratchet-Run-Id", ""),
                lease_version=int(self.headers.get("Ratchet-Lease-Version", "")),
                state_version=int(self.headers.get("Ratchet-State-Version", "")),
                store_epoch=self.headers.get("Ratchet-Store-Epoch") or None,
            )
        except (ValidationError, ValueError):
            return None

    def _post(self) -> None:
        if not self._authorised():
            return
        service = self.server.service
        body = self._body()
        if body is None:
            self._reply(400, {"error": "bad_body"})
            return
        if self.path == "/v1/fences":
            try:
                parsed = strict_json_loads(body)
            except ContractError:
                parsed = None
            fence = self._fence(parsed) if isinstance(parsed, dict) else None
            if fence is None:
                self._reply(400, {"error": "bad_fence"})
            else:
                self._reply(*service.raise_fence(fence))
            return
        if self.path != "/v1/orders":
            self._reply(404, {"error": "no_route"})
            return
        key = _identifier(self.headers.get("Idempotency-Key"))
        fence = self._fence()
        intent = self.headers.get("Ratchet-Intent-Digest", "")
        approval = self.headers.get("Ratchet-Approval-Digest")
        digests_ok = all(
            len(d) == 64 and all(c in "0123456789abcdef" for c in d)
            for d in [intent] + ([approval] if approval is not None else [])
        )
        try:
            order = strict_json_loads(body)
        except ContractError:
            order = None
        if key is None or fence is None or not digests_ok or not isinstance(order, dict):
            self._reply(400, {"error": "bad_request"})
            return
        try:
            status, payload = service.place_order(key, fence, intent, approval, body)
        except DropConnection:
            self.close_connection = True
            return
        self._reply(status, payload, {"Idempotent-Replayed": "true"} if status == 200 else None)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        service: OrdersService,
        *,
        token: str | None = None,
        max_connections: int = 32,
        read_timeout_s: float = 10.0,
    ) -> None:
        self.service = service
        self.token = token
        self.read_timeout_s = read_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        # Connections being served (kept alive between requests, too): stop() ends them,
        # as a process that exits does.
        self.open_requests: set[Any] = set()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread if a slot is free; otherwise answer 503 at
        once and close it (no thread, no read)."""
        if not self._slots.acquire(blocking=False):
            with suppress(OSError):
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                    b"Connection: close\r\n\r\n"
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out or reset is dropped quietly; anything else is
        reported as socketserver does."""
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self.open_requests.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.open_requests.discard(request)
            self._slots.release()


class RunningService:
    """A service listening on a loopback port in a background thread."""

    def __init__(
        self,
        service: OrdersService,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        max_connections: int = 32,
        read_timeout_s: float = 10.0,
    ) -> None:
        self.service = service
        self._server = _Server(
            (host, port),
            service,
            token=token,
            max_connections=max_connections,
            read_timeout_s=read_timeout_s,
        )
        host_bound, self.port = self._server.server_address[:2]
        self.host = host_bound.decode() if isinstance(host_bound, bytes) else str(host_bound)
        # A short poll interval keeps stop() prompt; the loop is idle otherwise.
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="orders-api",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"RunningService(url={self.url!r})"

    def stop(self) -> None:
        """Stop serving, close the listening socket and end every connection still open
        (a client's kept-alive one included), as a process that exits does."""
        self._server.shutdown()
        self._server.server_close()
        for request in list(self._server.open_requests):
            with suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        self._thread.join()

    def __enter__(self) -> RunningService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(
    service: OrdersService,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str | None = None,
    max_connections: int = 32,
    read_timeout_s: float = 10.0,
) -> RunningService:
    """Serve ``service`` over HTTP on ``host:port`` (0 picks a free port). ``token``
    guards the mutating routes; see the module docstring for the limits.

    Raises:
        OSError: the address cannot be bound.
    """
    return RunningService(
        service,
        host,
        port,
        token=token,
        max_connections=max_connections,
        read_timeout_s=read_timeout_s,
    )


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted; ``python -m ratchet.chaos.orders_server --db PATH``."""
    parser = argparse.ArgumentParser(description="reference orders API (SQLite-backed)")
    parser.add_argument("--db", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="a file holding the bearer token the mutating routes require",
    )
    args = parser.parse_args(argv)
    token = args.token_file.read_text().strip() if args.token_file else None
    running = serve(OrdersService(args.db), args.host, args.port, token=token or None)
    print(f"listening on {running.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
