"""The declared tools' ledger in the run's own keys: fenced at the store by the run's
live lease and generation, durable like a commit, and never an empty ledger where one is
gone."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from ratchet.errors import AdapterError, FenceRejectedError, IdempotencyConflictError
from ratchet.leasing import LeasedRun, RedisStore
from ratchet.runtime.ports import Fence, RunKey
from ratchet.tools.ledger import CallIntent
from ratchet.tools.store_ledger import StoreLedger


def _intent(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _fence(lease: LeasedRun, epoch: str | None = None) -> Fence:
    return Fence(
        run_id=lease.run_id,
        lease_version=lease.lease_version,
        state_version=lease.generation,
        store_epoch=epoch,
    )


def _acquire(store: RedisStore, run_id: str, owner: str, ttl_ms: int = 60_000) -> LeasedRun:
    got = store.try_acquire(run_id, owner=owner, ttl_ms=ttl_ms)
    if not isinstance(got, LeasedRun):
        raise AssertionError(f"not acquired: {got}")
    return got


def _start(led: StoreLedger, key: str, fence: Fence, *, durable: bool = True) -> object:
    return led.begin_call(
        key=key,
        tool="refund",
        intent_digest=_intent(key),
        approval_digest=None,
        fence=fence,
        expected_version=led.version,
        again=False,
        durable=durable,
    )


def _commit(led: StoreLedger, key: str, fence: Fence | None = None, **kw: object) -> object:
    call = CallIntent("refund", _intent(key), None, fence) if fence is not None else None
    return led.commit_call(
        key,
        namespace="tools",
        result={"tool": "refund", "output": '{"ok":1}'},
        committed_at=1_800_000_000,
        call=call,
        **kw,  # type: ignore[arg-type]
    )


def test_a_worker_never_makes_a_ledger_it_cannot_find(
    store: RedisStore, make_run: Callable[..., RunKey]
) -> None:
    run = make_run()
    with pytest.raises(AdapterError) as caught:
        StoreLedger(store, run.run_id)
    assert caught.value.reason == "ledger_missing"
    made = StoreLedger(store, run.run_id, create=True)
    assert made.version == 1 and made.instance_id.startswith("tools-")
    again = StoreLedger(store, run.run_id, create=True)  # never reset once made
    assert again.instance_id == made.instance_id


def test_a_call_is_started_committed_and_then_answered_from_its_receipt(
    store: RedisStore, make_run: Callable[..., RunKey]
) -> None:
    run = make_run()
    led = StoreLedger(store, run.run_id, create=True)
    fence = _fence(_acquire(store, run.run_id, "w1"), epoch="e1")
    led.raise_fence(fence)
    assert _start(led, "k1", fence) is None
    assert led.status("k1") == "started" and led.row("k1").attempts == 1  # type: ignore[union-attr]
    receipt = _commit(led, "k1")
    assert led.version == 2 and led.counters() == (1, 0)
    assert receipt.receipt_id == f"{led.instance_id}/1"  # type: ignore[attr-defined]
    assert receipt.env_version_after == 2  # type: ignore[attr-defined]
    # The same key and intent: the receipt, no second call; the version stays.
    assert _start(led, "k1", fence) == receipt
    assert led.version == 2 and led.store_epoch == "e1"
    with pytest.raises(IdempotencyConflictError) as caught:
        led.begin_call(
            key="k1",
            tool="refund",
            intent_digest=_intent("another"),
            approval_digest=None,
            fence=fence,
            expected_version=2,
            again=False,
        )
    assert caught.value.receipt == receipt


def test_a_stale_worker_is_refused_at_the_store_and_counted(
    store: RedisStore,
    make_run: Callable[..., RunKey],
    expire: Callable[[RedisStore, str], None],
) -> None:
    run = make_run()
    led = StoreLedger(store, run.run_id, create=True)
    old = _fence(_acquire(store, run.run_id, "w-old", ttl_ms=100))
    led.raise_fence(old)
    expire(store, run.run_id)
    # Its lease expired: refused even before anyone else took the run.
    with pytest.raises(FenceRejectedError) as caught:
        _start(led, "k1", old)
    assert caught.value.reason == "expired"
    new = _fence(_acquire(store, run.run_id, "w-new"))
    with pytest.raises(FenceRejectedError) as caught:
        _start(led, "k1", old, durable=False)  # even the check a lookup tool gets
    assert caught.value.reason == "lost"
    assert led.status("k1") is None
    assert _start(led, "k1", new) is None
    assert led.counters() == (0, 2)
    # A fence at another generation than the store's is refused too.
    ahead = new.model_copy(update={"state_version": new.state_version + 1})
    with pytest.raises(FenceRejectedError) as caught:
        led.raise_fence(ahead)
    assert caught.value.reason == "generation"


def test_what_became_of_an_admitted_call_is_kept_whoever_reports_it(
    store: RedisStore,
    make_run: Callable[..., RunKey],
    expire: Callable[[RedisStore, str], None],
) -> None:
    """A call admitted under a live lease happened; the worker lost its lease while the
    tool ran. Its receipt is recorded anyway: refusing it would lose the only record of
    an effect (the next owner then answers from it instead of calling again)."""
    run = make_run()
    led = StoreLedger(store, run.run_id, create=True)
    fence = _fence(_acquire(store, run.run_id, "w1", ttl_ms=100))
    assert _start(led, "k1", fence) is None
    expire(store, run.run_id)
    receipt = _commit(led, "k1")
    new = _fence(_acquire(store, run.run_id, "w2"))
    assert _start(led, "k1", new) == receipt


def test_a_precondition_an_unresolved_start_and_an_abort_behave_as_the_file_ledger(
    store: RedisStore, make_run: Callable[..., RunKey]
) -> None:
    run = make_run()
    led = StoreLedger(store, run.run_id, create=True)
    fence = _fence(_acquire(store, run.run_id, "w1"))
    with pytest.raises(AdapterError, match="precondition") as caught:
        led.begin_call(
            key="k1",
            tool="refund",
            intent_digest=_intent("k1"),
            approval_digest=None,
            fence=fence,
            expected_version=7,
            again=False,
        )
    assert not caught.value.retryable
    assert _start(led, "k1", fence) is None
    with pytest.raises(AdapterError, match="unresolved") as caught:
        _start(led, "k1", fence)
    assert caught.value.retryable
    led.abort_call("k1")
    assert led.status("k1") == "aborted" and led.version == 1
    assert _start(led, "k1", fence) is None  # an aborted key may be sent again
    assert led.row("k1").attempts == 2  # type: ignore[union-attr]
    # A call with no row (a lookup tool's) is recorded once it returned.
    assert _start(led, "k2", fence, durable=False) is None
    assert led.status("k2") is None
    receipt = _commit(led, "k2", fence)
    assert receipt.idempotency_key == "k2" and led.version == 2  # type: ignore[attr-defined]
    with pytest.raises(AdapterError, match="no recorded call"):
        _commit(led, "never-started")


def test_a_ledger_that_vanished_is_an_error_never_an_empty_ledger(
    store: RedisStore, make_run: Callable[..., RunKey]
) -> None:
    run = make_run()
    led = StoreLedger(store, run.run_id, create=True)
    fence = _fence(_acquire(store, run.run_id, "w1"))
    assert _start(led, "k1", fence) is None
    store.client.delete(f"ratchet:{{{run.run_id}}}:ledger")
    with pytest.raises(AdapterError) as caught:
        led.refresh()
    assert caught.value.reason == "ledger_missing"
    with pytest.raises(AdapterError):
        _start(led, "k2", fence)
    # A new one (another instance) is not the old one: a restore sees the instance moved.
    remade = StoreLedger(store, run.run_id, create=True)
    assert remade.instance_id != led.instance_id
