"""The reference orders service and the HTTP adapter: idempotency, in-flight duplicates,
stale fences, lost replies and timeouts (always followed by a lookup), restarts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ratchet.adapters import HttpAdapter
from ratchet.chaos.orders import DropConnection
from ratchet.errors import AdapterError, FenceRejectedError, IdempotencyConflictError
from ratchet.runtime import Action, Fence
from tests.adapters.conftest import ServiceBox
from tests.adapters.harness import order, raw_post


def fence(lease: int = 1, state: int = 1, run_id: str = "r") -> Fence:
    return Fence(run_id=run_id, lease_version=lease, state_version=state)


def send(adapter: HttpAdapter, action: Action, f: Fence, approval: str | None = None):  # type: ignore[no-untyped-def]
    return adapter.execute(action, action.intent_digest, f, approval)


class Gate:
    """Holds requests for one key in flight until released; tells when one is held."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.held = threading.Event()
        self.release = threading.Event()

    def __call__(self, stage: str, key: str) -> None:
        if stage == "in_flight" and key == self.key:
            self.held.set()
            if not self.release.wait(timeout=30):
                raise AssertionError("gate was never released")


def test_same_key_and_body_returns_the_stored_receipt_and_another_body_gets_422(
    orders: ServiceBox,
) -> None:
    adapter = HttpAdapter(orders.url)
    first = send(adapter, order("k-1"), fence())
    assert send(adapter, order("k-1"), fence()) == first
    other = order("k-1", '{"sku":"B-2","qty":5}')
    assert raw_post(orders, "k-1", other.args["body"], fence(), other.intent_digest) == 422
    with pytest.raises(IdempotencyConflictError) as caught:
        send(adapter, other, fence())
    assert caught.value.receipt == first
    assert orders.effects() == 1


def test_a_concurrent_duplicate_in_flight_gets_409_and_is_retryable(orders: ServiceBox) -> None:
    gate = Gate("k-1")
    orders.restart(hook=gate)
    adapter = HttpAdapter(orders.url)
    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(send(adapter, order("k-1"), fence())))
    first.start()
    assert gate.held.wait(timeout=30)
    with pytest.raises(AdapterError) as caught:
        send(adapter, order("k-1"), fence())
    assert caught.value.retryable is True
    assert not isinstance(caught.value, FenceRejectedError | IdempotencyConflictError)
    gate.release.set()
    first.join(timeout=30)
    assert results and results[0] == adapter.lookup("k-1")
    assert orders.effects() == 1


def test_a_stale_fence_is_refused_even_when_it_arrives_after_the_newer_one(
    orders: ServiceBox,
) -> None:
    adapter = HttpAdapter(orders.url)
    send(adapter, order("new-owner"), fence(2, 1))
    with pytest.raises(FenceRejectedError):
        send(adapter, order("old-owner"), fence(1, 9))
    assert adapter.lookup("old-owner") is None
    assert orders.effects() == 1 and adapter.stats()["refused_stale"] == 1


def test_a_request_in_flight_when_a_newer_fence_arrives_is_refused_at_commit(
    orders: ServiceBox,
) -> None:
    gate = Gate("old-owner")
    orders.restart(hook=gate)
    adapter = HttpAdapter(orders.url)
    outcome: list[BaseException] = []

    def old_owner() -> None:
        try:
            send(adapter, order("old-owner"), fence(1, 5))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=old_owner)
    thread.start()
    assert gate.held.wait(timeout=30)
    HttpAdapter(orders.url).raise_fence(fence(2, 5))  # the new owner takes over
    gate.release.set()
    thread.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], FenceRejectedError)
    assert adapter.lookup("old-owner") is None and orders.effects() == 0


def test_a_lost_reply_after_the_commit_is_answered_by_a_lookup_not_a_resend(
    orders: ServiceBox,
) -> None:
    def drop_reply(stage: str, key: str) -> None:
        if stage == "committed":
            raise DropConnection

    orders.restart(hook=drop_reply)
    adapter = HttpAdapter(orders.url)
    receipt = send(adapter, order("k-1"), fence())
    assert receipt == adapter.lookup("k-1")
    assert orders.effects() == 1


def test_a_timeout_while_in_flight_is_unknown_then_settled_by_the_receipt(
    orders: ServiceBox,
) -> None:
    gate = Gate("k-1")
    orders.restart(hook=gate)
    impatient = HttpAdapter(orders.url, timeout_seconds=0.3)
    try:
        with pytest.raises(AdapterError) as caught:
            send(impatient, order("k-1"), fence())
        assert caught.value.retryable is True
        assert gate.held.wait(timeout=30)
    finally:
        gate.release.set()
    patient = HttpAdapter(orders.url)
    deadline = time.monotonic() + 30
    while (receipt := _lookup_settled(patient, "k-1")) is None:
        assert time.monotonic() < deadline, "the held request never committed"
    assert send(patient, order("k-1"), fence(1, 2)) == receipt
    assert orders.effects() == 1


def _lookup_settled(adapter: HttpAdapter, key: str):  # type: ignore[no-untyped-def]
    try:
        return adapter.lookup(key)
    except AdapterError:
        return None  # still in flight


def test_an_unreachable_service_is_a_retryable_unknown_outcome(orders: ServiceBox) -> None:
    adapter = HttpAdapter(orders.url)
    orders.stop()
    with pytest.raises(AdapterError) as caught:
        send(adapter, order("k-1"), fence())
    assert caught.value.retryable is True
    orders.start()
    assert adapter.lookup("k-1") is None and orders.effects() == 0


def test_the_service_keeps_receipts_fences_and_identity_across_a_restart(
    orders: ServiceBox,
) -> None:
    adapter = HttpAdapter(orders.url)
    receipt = send(adapter, order("k-1"), fence(3, 1))
    identity = adapter.observe()
    orders.restart()
    assert adapter.observe() == identity
    assert adapter.lookup("k-1") == receipt
    with pytest.raises(FenceRejectedError):
        adapter.raise_fence(fence(2, 0))
    orders.reset()
    assert adapter.observe().instance_id != identity.instance_id


def test_the_adapter_refuses_kinds_and_operations_it_does_not_serve(orders: ServiceBox) -> None:
    adapter = HttpAdapter(orders.url, operations={"cancel-order": "/v1/cancellations"})
    with pytest.raises(AdapterError) as caught:
        send(adapter, order("k-1"), fence())
    assert caught.value.retryable is False
    with pytest.raises(AdapterError):
        adapter.verify("unit")
    assert orders.effects() == 0


def test_the_reference_service_runs_as_its_own_process_for_the_drills(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ratchet.chaos.orders_server",
            "--db",
            str(tmp_path / "orders.sqlite3"),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:")
        adapter = HttpAdapter(line.split()[-1])
        receipt = send(adapter, order("k-1"), fence())
        assert adapter.lookup("k-1") == receipt and adapter.stats()["effects"] == 1
    finally:
        proc.kill()
        proc.communicate(timeout=30)


def test_reads_share_one_kept_connection_and_writes_each_open_their_own(
    orders: ServiceBox, monkeypatch: pytest.MonkeyPatch
) -> None:
    import http.client

    opened: list[str] = []
    connect = http.client.HTTPConnection.connect

    def counted(self: http.client.HTTPConnection) -> None:
        opened.append("connect")
        connect(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", counted)
    adapter = HttpAdapter(orders.url)
    identity = adapter.observe()
    for _ in range(4):
        assert adapter.observe() == identity
    assert adapter.lookup("k-none") is None
    assert len(opened) == 1  # five identity reads and a lookup on one connection
    send(adapter, order("k-1"), fence())
    send(adapter, order("k-2"), fence())
    assert len(opened) == 3  # a fence and a write each time: fresh connections
    adapter.observe()
    assert len(opened) == 3  # the kept read connection is still there
    # The server goes away and comes back: the kept connection is dead; the read is sent
    # again on a fresh one, once, and succeeds.
    orders.restart()
    assert adapter.observe().instance_id == identity.instance_id
    assert len(opened) == 4
    adapter.close()
    adapter.observe()  # usable after close: a new connection
    assert len(opened) == 5
    adapter.close()
