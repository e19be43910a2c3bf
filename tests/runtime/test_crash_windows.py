"""A crash in every window, then recovery by a new owner: exactly one adapter write per
intent, and the run finishes. Also: stale owners are fenced, concurrent recoveries race
on one generation and exactly one wins."""

from __future__ import annotations

import pytest

from ratchet.errors import (
    CommitOutcomeUnknownError,
    FenceRejectedError,
    GenerationMismatchError,
    LeaseLostError,
)
from ratchet.runtime import CrashWindow, Phase, RunEngine, TraceOutcome
from ratchet.testing.memory import ObserveFailsAfterWrite
from tests.runtime.world import RIGHT_GREETING, SimulatedCrash, World, crash_at


def finish(world: World, engine: RunEngine) -> None:
    assert engine.propose(world.verify(engine)).outcome is TraceOutcome.VERIFIED
    assert engine.propose(world.finish(engine)).phase is Phase.COMPLETED


WRITE_WINDOWS = [
    CrashWindow.AFTER_PENDING_BEFORE_ADAPTER,
    CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT,
    CrashWindow.AFTER_RECEIPT_BEFORE_STATE,
]


@pytest.mark.parametrize("window", WRITE_WINDOWS)
def test_a_crash_in_each_write_window_recovers_with_exactly_one_write(
    world: World, window: CrashWindow
) -> None:
    engine = world.start(probe=crash_at(window))
    if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
        # Receipt and state are one commit; the receipt is committed alone only when the
        # environment cannot be observed right after the write.
        engine.executor.hooks = ObserveFailsAfterWrite(engine.executor.hooks)
    with pytest.raises(SimulatedCrash):
        engine.propose(world.write(engine, key="fix-1"))

    resumed = world.resume()
    assert resumed.reconcile().window is window
    assert world.adapter.write_count == 1
    assert world.adapter.files["app.py"] == RIGHT_GREETING
    assert resumed.state.pending is None
    assert resumed.state.executed[-1].idempotency_key == "fix-1"
    finish(world, resumed)
    assert world.adapter.write_count == 1


def test_a_crash_before_a_proposal_recovers_from_the_whole_checkpoint(world: World) -> None:
    engine = world.start(probe=crash_at(CrashWindow.BEFORE_PROPOSAL))
    with pytest.raises(SimulatedCrash):
        engine.propose(world.write(engine, key="fix-1"))
    resumed = world.resume()
    assert resumed.reconcile().window is CrashWindow.BEFORE_PROPOSAL
    assert world.adapter.write_count == 0
    resumed.propose(world.write(resumed, key="fix-1"))
    finish(world, resumed)
    assert world.adapter.write_count == 1


def test_recovery_is_idempotent_when_the_recovering_worker_crashes_too(world: World) -> None:
    engine = world.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    with pytest.raises(SimulatedCrash):
        engine.propose(world.write(engine, key="fix-1"))
    second = world.resume(probe=crash_at(CrashWindow.AFTER_RECEIPT_BEFORE_STATE), lease_version=2)
    blind = ObserveFailsAfterWrite(second.executor.hooks)
    blind._armed = True  # the recovering worker cannot observe either
    second.executor.hooks = blind
    with pytest.raises(SimulatedCrash):
        second.reconcile()
    third = world.resume(lease_version=3)
    assert third.reconcile().window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE
    finish(world, third)
    assert world.adapter.write_count == 1


def test_an_approved_committed_write_recovers_with_signed_evidence(world: World) -> None:
    """The spec's exemplar: approved write committed by the adapter, crash before the
    receipt is persisted; recovery checks the approval trust root, the environment and
    the receipt, and the write count stays one."""
    engine = world.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    engine.propose(world.order(engine))
    with pytest.raises(SimulatedCrash):
        engine.refresh_pending_approval(world.approve(engine))
    resumed = world.resume()
    assert resumed.reconcile().window is CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT
    assert resumed.state.trace[-1].outcome is TraceOutcome.RECONCILED
    assert len(world.adapter.external_calls) == 1
    receipt = resumed.state.executed[-1].receipt
    assert receipt.approval_digest is not None


def test_a_lost_commit_reply_is_resolved_by_re_reading_the_store(world: World) -> None:
    engine = world.start()
    world.store.lose_next_reply = True
    assert engine.propose(world.write(engine, key="fix-1")).outcome is TraceOutcome.EXECUTED
    assert world.store.high_water(engine.key) == engine.generation
    assert world.adapter.write_count == 1


def test_a_lost_reply_for_a_commit_that_did_not_apply_is_not_assumed(world: World) -> None:
    engine = world.start()
    original = world.store.commit_batch

    def lose_without_applying(*args: object, **kw: object) -> None:
        raise CommitOutcomeUnknownError("connection dropped before the script ran")

    world.store.commit_batch = lose_without_applying  # type: ignore[method-assign]
    generation = engine.generation
    with pytest.raises(CommitOutcomeUnknownError):
        engine.propose(world.write(engine, key="fix-1"))
    assert engine.generation == generation
    world.store.commit_batch = original  # type: ignore[method-assign]
    assert world.adapter.write_count == 0


def test_a_stale_owner_is_fenced_by_the_adapter_and_the_store(world: World) -> None:
    old = world.start()
    old.propose(world.write(old, "print('v1')\n", key="fix-1"))
    new = world.resume(lease_version=2)  # raises the adapter fence to lease 2
    new.reconcile()
    # The late pending intent is refused by the store; its adapter call by the fence.
    with pytest.raises(LeaseLostError):
        old.propose(world.write(old, "print('late')\n", key="fix-2"))
    with pytest.raises(FenceRejectedError):
        old.executor.adapter.execute(
            world.write(old, "print('late')\n", key="fix-2"), "0" * 64, old._fence(), None
        )
    assert world.adapter.refused_stale == 1
    assert "late" not in world.adapter.files["app.py"]
    generation = world.store.high_water(new.key)
    with pytest.raises(LeaseLostError):
        old.cancel("late commit from a stale worker")
    assert world.store.high_water(new.key) == generation
    new.propose(world.action(new, "read_file", {"path": "app.py"}))
    assert world.store.high_water(new.key) == generation + 1


def test_two_recovering_workers_on_one_generation_exactly_one_commits(world: World) -> None:
    engine = world.start()
    engine.propose(world.write(engine, key="fix-1"))
    blob = engine.checkpoint
    # Leases aside (both believe they own the run), the generation compare-and-set alone
    # must let exactly one of them advance.
    first = RunEngine.resume(blob, **world.ports())
    second = RunEngine.resume(blob, **world.ports())
    winners, losers = 0, 0
    for contender in (first, second):
        try:
            contender.propose(world.action(contender, "read_file", {"path": "app.py"}))
            winners += 1
        except GenerationMismatchError:
            losers += 1
    assert (winners, losers) == (1, 1)
    assert world.store.high_water(engine.key) == engine.generation + 1


def test_an_unexplained_effect_without_a_receipt_opens_a_review(world: World) -> None:
    engine = world.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    with pytest.raises(SimulatedCrash):
        engine.propose(world.write(engine, key="fix-1"))
    world.adapter.delete_receipt("fix-1")  # the adapter lost its record, the file changed
    resumed = world.resume()
    resumed.reconcile()
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert world.adapter.write_count == 1


def test_a_recorded_receipt_that_drifted_before_recovery_opens_a_review(world: World) -> None:
    engine = world.start(probe=crash_at(CrashWindow.AFTER_RECEIPT_BEFORE_STATE))
    engine.executor.hooks = ObserveFailsAfterWrite(engine.executor.hooks)
    with pytest.raises(SimulatedCrash):
        engine.propose(world.write(engine, key="fix-1"))
    world.adapter.replace_receipt("fix-1", receipt_id="rcpt-rewritten")
    resumed = world.resume()
    resumed.reconcile()
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert world.adapter.write_count == 1


def test_the_crash_window_enum_names_the_four_spec_windows_and_the_lost_reply() -> None:
    assert [w.value for w in CrashWindow] == [
        "before_proposal",
        "after_pending_before_adapter",
        "after_adapter_before_receipt",
        "after_receipt_before_state",
        "commit_reply_lost",
    ]
