"""The reference orders service is safe to run as documented: read timeouts drop slow
clients, a bounded pool answers 503 beyond it instead of starting threads, and with a
token nobody else can raise a run's fence or place an order."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.adapters import HttpAdapter
from ratchet.chaos.orders import OrdersService, RunningService, serve
from ratchet.errors import AdapterError
from ratchet.runtime import Fence
from tests.adapters.harness import order

TOKEN = "orders-token-0123456789abcdef-CANARY"


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[RunningService]:
    running = serve(
        OrdersService(tmp_path / "orders.sqlite3"),
        token=TOKEN,
        max_connections=4,
        read_timeout_s=3.0,
    )
    try:
        yield running
    finally:
        running.stop()


def post(running: RunningService, path: str, body: bytes, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection(running.host, running.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_without_the_token_no_fence_is_raised_and_no_order_placed(
    guarded: RunningService,
) -> None:
    hostile = b'{"lease_version":999999,"run_id":"r","state_version":999999}'
    assert post(guarded, "/v1/fences", hostile, {"Content-Type": "application/json"}) == 401
    assert post(guarded, "/v1/fences", hostile, {"Authorization": "Bearer wrong"}) == 401
    # The run's real owner is not blocked: its fence and its order go through.
    adapter = HttpAdapter(guarded.url, token=TOKEN)
    adapter.raise_fence(Fence(run_id="r", lease_version=1, state_version=1))
    action = order("k-1")
    receipt = adapter.execute(
        action, action.intent_digest, Fence(run_id="r", lease_version=1, state_version=1), None
    )
    assert receipt.idempotency_key == "k-1"
    assert guarded.service.stats()[1]["effects"] == 1
    assert guarded.service.stats()[1]["refused_stale"] == 0


def test_an_adapter_without_the_token_is_refused_for_good(guarded: RunningService) -> None:
    adapter = HttpAdapter(guarded.url)
    with pytest.raises(AdapterError) as err:
        adapter.raise_fence(Fence(run_id="r", lease_version=1, state_version=1))
    assert err.value.retryable is False
    assert adapter.observe().version == 0  # reads need no token
    assert TOKEN not in repr(HttpAdapter(guarded.url, token=TOKEN))


def test_slow_clients_are_dropped_by_the_read_timeout_and_the_pool_stays_bounded(
    guarded: RunningService,
) -> None:
    """Clients that never finish their headers (slowloris) hold a slot only until the
    read timeout; beyond the pool's size a connection is answered 503 at once."""
    slow = []
    for _ in range(4):
        sock = socket.create_connection((guarded.host, guarded.port), timeout=10)
        sock.sendall(b"GET /v1/identity HTTP/1.1\r\nHost: x\r\n")  # headers never end
        slow.append(sock)
    # The pool is full (once the server accepted all four, well within their read
    # timeout): the next connection is answered 503 without a thread.
    deadline = time.monotonic() + 2
    status = None
    while time.monotonic() < deadline:
        try:
            extra = socket.create_connection((guarded.host, guarded.port), timeout=10)
            extra.sendall(b"GET /v1/identity HTTP/1.1\r\nHost: x\r\n\r\n")
            status = extra.recv(64)
            extra.close()
        except OSError:
            status = None
        if status and status.startswith(b"HTTP/1.1 503"):
            break
    assert status is not None and status.startswith(b"HTTP/1.1 503")
    handlers = [t for t in threading.enumerate() if "process_request_thread" in t.name]
    assert len(handlers) <= 4  # the pool's size, however many clients connected
    # After the read timeout the slow clients are gone and the service answers again.
    for sock in slow:
        sock.settimeout(10)
        assert sock.recv(1) in (b"", b"H")  # closed (or an error reply) by the server
        sock.close()
    conn = http.client.HTTPConnection(guarded.host, guarded.port, timeout=10)
    deadline = time.monotonic() + 10
    while True:
        try:
            conn.request("GET", "/v1/identity")
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                break
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection(guarded.host, guarded.port, timeout=10)
        if time.monotonic() > deadline:
            raise AssertionError("the service did not recover after the slow clients")
    conn.close()


def test_a_locked_database_is_a_503_and_the_order_lands_once_when_it_is_free(
    tmp_path: Path,
) -> None:
    """The service's SQLite file held by another process past the busy timeout: the
    request rolls back and answers 503, the adapter reports a retryable failure (the
    outcome looked up, never guessed), and the next try places the order once."""
    import sqlite3

    db_path = tmp_path / "orders.sqlite3"
    running = serve(OrdersService(db_path, busy_timeout_s=0.2), read_timeout_s=3.0)
    try:
        fence = Fence(run_id="r", lease_version=1, state_version=1)
        adapter = HttpAdapter(running.url)
        action = order("k-1")
        other = sqlite3.connect(db_path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        try:
            assert (
                post(
                    running,
                    "/v1/fences",
                    b'{"lease_version":1,"run_id":"r","state_version":1}',
                    {"Content-Type": "application/json"},
                )
                == 503
            )
            with pytest.raises(AdapterError) as failed:
                adapter.execute(action, action.intent_digest, fence, None)
            assert failed.value.retryable is True
        finally:
            other.rollback()
            other.close()
        assert running.service.stats()[1]["effects"] == 0
        receipt = adapter.execute(action, action.intent_digest, fence, None)
        assert adapter.execute(action, action.intent_digest, fence, None) == receipt
        assert running.service.stats()[1]["effects"] == 1
    finally:
        running.stop()
