"""Receipts are the evidence: same key and intent replays, same key and another intent is a
conflict, and a cache that disagrees with the adapter never counts as a replay."""

from __future__ import annotations

from typing import Any

import pytest

from ratchet.errors import AdapterError, InvalidTransitionError
from ratchet.runtime import CrashWindow, Phase, ReviewReason, RunEngine, TraceOutcome
from ratchet.testing.memory import ObserveFailsAfterWrite
from ratchet.worker.executor import WindowProbe
from tests.runtime.world import RIGHT_GREETING, World, plant_foreign_receipt


@pytest.fixture
def written(world: World) -> RunEngine:
    engine = world.start()
    assert engine.propose(world.write(engine, key="fix-1")).outcome is TraceOutcome.EXECUTED
    return engine


def test_the_same_key_and_intent_replays_the_receipt_without_a_second_write(
    world: World, written: RunEngine
) -> None:
    result = written.propose(world.write(written, key="fix-1"))
    assert result.outcome is TraceOutcome.REPLAYED
    assert world.adapter.write_count == 1
    assert len(written.state.executed) == 1


def test_a_replay_needs_a_fresh_approval_where_policy_requires_one(world: World) -> None:
    engine = world.start()
    engine.propose(world.order(engine))
    engine.refresh_pending_approval(world.approve(engine))
    assert world.adapter.write_count == 1
    again = engine.propose(world.order(engine))
    assert again.outcome is TraceOutcome.AWAITING_APPROVAL
    assert engine.refresh_pending_approval(world.approve(engine)).outcome is TraceOutcome.REPLAYED
    assert world.adapter.write_count == 1
    assert len(world.adapter.external_calls) == 1


def test_the_same_key_with_another_intent_is_rejected_at_proposal(
    world: World, written: RunEngine
) -> None:
    result = written.propose(world.write(written, "print('other')\n", key="fix-1"))
    assert result.outcome is TraceOutcome.REJECTED_KEY_CONFLICT
    assert written.state.phase is Phase.RUNNING
    assert world.adapter.write_count == 1


def test_the_same_key_with_another_intent_at_execution_freezes_the_run_with_evidence(
    world: World,
) -> None:
    engine = world.start()
    foreign = plant_foreign_receipt(world, "fix-1")
    action = world.write(engine, key="fix-1")
    assert engine.propose(action).outcome is TraceOutcome.REVIEW_OPENED
    state = engine.state
    assert state.phase is Phase.NEEDS_REVIEW
    assert state.pending is not None and state.pending.action == action  # kept, not popped
    assert state.review is not None
    assert state.review.reason is ReviewReason.INTENT_CONFLICT
    assert state.review.receipt == foreign
    assert state.review.receipt_fingerprint == foreign.fingerprint
    assert world.adapter.write_count == 0
    # Frozen: no new proposal, no direct execution.
    assert engine.propose(world.write(engine, key="fix-2")).outcome is TraceOutcome.REJECTED_PHASE
    with pytest.raises(InvalidTransitionError):
        engine.execute_pending()


def test_a_deleted_adapter_receipt_is_never_a_replay(world: World, written: RunEngine) -> None:
    world.adapter.delete_receipt("fix-1")
    result = written.propose(world.write(written, key="fix-1"))
    assert result.outcome is TraceOutcome.REVIEW_OPENED
    assert written.state.review is not None
    assert written.state.review.reason is ReviewReason.RECEIPT_MISSING
    assert world.adapter.write_count == 1


@pytest.mark.parametrize(
    "drift",
    [
        {"namespace": "other-ns"},
        {"receipt_version": 2},
        {"receipt_id": "rcpt-77"},
        {"intent_digest": "b" * 64},
        {"result": {"path": "app.py", "bytes": 1}},
        {"committed_at": 1},
    ],
)
def test_any_drift_between_cache_and_adapter_is_never_a_replay(
    world: World, written: RunEngine, drift: dict[str, Any]
) -> None:
    world.adapter.replace_receipt("fix-1", **drift)
    result = written.propose(world.write(written, key="fix-1"))
    assert result.outcome is TraceOutcome.REVIEW_OPENED
    assert written.state.phase is Phase.NEEDS_REVIEW
    assert written.state.review is not None
    expected = (
        ReviewReason.INTENT_CONFLICT if "intent_digest" in drift else ReviewReason.RECEIPT_DRIFT
    )
    assert written.state.review.reason is expected
    assert world.adapter.write_count == 1


def test_a_missing_cache_entry_is_rebuilt_from_a_complete_adapter_receipt(world: World) -> None:
    """The cache is only a copy: the adapter's receipt alone recovers the write."""
    engine = world.start()

    class Crash(Exception):
        pass

    def crash(window: Any) -> None:
        if window.value == "after_adapter_before_receipt":
            raise Crash

    engine.executor.hooks = WindowProbe(crash)
    with pytest.raises(Crash):
        engine.propose(world.write(engine, key="fix-1"))
    assert engine.state.executed == ()  # nothing cached
    resumed = world.resume()
    resumed.reconcile()
    assert resumed.state.executed[-1].receipt == world.adapter.lookup("fix-1")
    assert resumed.state.environment.fingerprint == world.adapter.observe().fingerprint
    assert world.adapter.files["app.py"] == RIGHT_GREETING
    assert world.adapter.write_count == 1


# --- the cache lost an entry the adapter still holds --------------------------------------


def second_run(world: World) -> RunEngine:
    """Another run on the same adapter: its cache of executed writes is empty, while the
    adapter holds the receipts of what the first run did."""
    return RunEngine.start("run-2", **world.ports(store=world.store.leased(1)))


def test_a_key_the_adapter_holds_but_the_cache_lost_replays_from_the_receipt(
    world: World, written: RunEngine
) -> None:
    other = second_run(world)
    before = world.adapter.observe()
    result = other.propose(world.write(other, key="fix-1"))
    assert result.outcome is TraceOutcome.REPLAYED
    state = other.state
    assert state.phase is Phase.RUNNING and state.pending is None
    assert state.executed[-1].receipt == world.adapter.lookup("fix-1")  # cache rebuilt
    assert state.environment == before == world.adapter.observe()
    assert world.adapter.write_count == 1
    # And the run goes on: verify and finish on the unchanged environment.
    assert other.propose(world.verify(other)).outcome is TraceOutcome.VERIFIED
    assert other.propose(world.finish(other)).phase is Phase.COMPLETED


@pytest.mark.parametrize("window", ["after_adapter_before_receipt", "receipt_committed_alone"])
def test_recovering_a_key_the_cache_lost_never_wedges(
    world: World, written: RunEngine, window: str
) -> None:
    """Reconcile settles it from the adapter's receipt, whichever window the worker died
    in (before the receipt was committed, or after it was committed alone)."""

    class Crash(Exception):
        pass

    def crash(seen: CrashWindow) -> None:
        if seen.value == (
            "after_adapter_before_receipt"
            if window == "after_adapter_before_receipt"
            else "after_receipt_before_state"
        ):
            raise Crash

    other = RunEngine.start("run-2", **world.ports(store=world.store.leased(1), probe=crash))
    if window == "receipt_committed_alone":
        other.executor.hooks = ObserveFailsAfterWrite(other.executor.hooks)
    with pytest.raises((Crash, AdapterError)):
        other.propose(world.write(other, key="fix-1"))
    stored = world.store.load(other.key)
    store = world.store.leased(2)
    store.claim("run-2")
    resumed = RunEngine.resume(stored.blob, lease_version=2, **world.ports(store=store))
    resumed.reconcile()
    assert resumed.state.pending is None and resumed.state.phase is Phase.RUNNING
    assert resumed.state.trace[-1].outcome is TraceOutcome.REPLAYED
    assert resumed.state.executed[-1].receipt == world.adapter.lookup("fix-1")
    assert world.adapter.write_count == 1


def test_a_key_the_cache_lost_with_another_intent_is_a_conflict_not_a_wedge(
    world: World, written: RunEngine
) -> None:
    other = second_run(world)
    result = other.propose(world.write(other, "print('other')\n", key="fix-1"))
    assert result.outcome is TraceOutcome.REVIEW_OPENED
    assert other.state.review is not None
    assert other.state.review.reason is ReviewReason.INTENT_CONFLICT
    assert world.adapter.write_count == 1
