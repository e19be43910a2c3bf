"""Operator controls in the core: a cancel ends a run at a safe point without abandoning a
write in an unknown state, and a reviewer's signed rebaseline makes a changed environment
the run's new baseline, voiding every approval bound to the old one."""

from __future__ import annotations

import pytest

from ratchet.errors import (
    ApprovalError,
    CheckpointError,
    FenceRejectedError,
    InvalidTransitionError,
    ReviewDecisionError,
)
from ratchet.runtime import CrashWindow, Phase, RunEngine, TraceOutcome
from ratchet.runtime.decisions import check_rebaseline, decision_baseline
from tests.runtime.world import (
    RIGHT_GREETING,
    SimulatedCrash,
    World,
    crash_at,
    plant_foreign_receipt,
)

# --- cancel --------------------------------------------------------------------------------


def cancel_detail(engine: RunEngine) -> dict[str, object]:
    event = engine.state.trace[-1]
    assert event.outcome is TraceOutcome.CANCELLED
    return dict(event.detail)


def test_a_cancel_is_attributed_in_the_signed_trace(world: World) -> None:
    engine = world.start()
    result = engine.cancel("wrong task", by="olga", request_id="cx-1")
    assert result.phase is Phase.CANCELLED
    assert cancel_detail(engine) | {} == {
        "reason": "wrong task",
        "by": "olga",
        "request_id": "cx-1",
    }
    assert engine.state.stop_reason == "cancelled: wrong task"
    resumed = world.resume()  # the cancellation is a commit like any other
    assert resumed.state.phase is Phase.CANCELLED


def test_a_cancel_drops_a_write_waiting_for_approval_and_records_it(world: World) -> None:
    engine = world.start()
    engine.propose(world.order(engine))
    assert engine.state.phase is Phase.AWAITING_APPROVAL
    intent = engine.state.pending.intent_digest if engine.state.pending else ""
    engine.cancel("not needed")
    detail = cancel_detail(engine)
    assert detail["dropped_key"] == "order-1" and detail["dropped_intent"] == intent
    assert engine.state.pending is None and world.adapter.write_count == 0


def test_a_write_that_never_reached_the_adapter_is_dropped_after_a_lookup(world: World) -> None:
    old = world.start(probe=crash_at(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER))
    with pytest.raises(SimulatedCrash):
        old.propose(world.write(old, key="fix-1"))
    resumed = world.resume()  # no reconcile: the cancel settles the write itself
    resumed.cancel("stop", by="olga")
    detail = cancel_detail(resumed)
    assert detail["looked_up"] == "absent" and detail["dropped_key"] == "fix-1"
    assert world.adapter.write_count == 0
    # The old owner's late write cannot land any more: the fence went up first.
    pending_action = world.write(old, key="fix-1")
    with pytest.raises(FenceRejectedError):
        old.executor.adapter.execute(
            pending_action, pending_action.intent_digest, old._fence(), None
        )
    assert world.adapter.write_count == 0


def test_a_write_the_adapter_made_is_recorded_as_executed_before_the_run_ends(
    world: World,
) -> None:
    old = world.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    with pytest.raises(SimulatedCrash):
        old.propose(world.write(old, key="fix-1"))
    resumed = world.resume()
    resumed.cancel("stop")
    assert resumed.state.phase is Phase.CANCELLED
    assert [e.idempotency_key for e in resumed.state.executed] == ["fix-1"]
    assert cancel_detail(resumed)["executed_key"] == "fix-1"
    assert world.adapter.write_count == 1 and world.adapter.files["app.py"] == RIGHT_GREETING


def test_a_key_holding_another_intent_opens_a_review_instead_of_ending(world: World) -> None:
    old = world.start(probe=crash_at(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER))
    with pytest.raises(SimulatedCrash):
        old.propose(world.write(old, key="fix-1"))
    plant_foreign_receipt(world, "fix-1")
    resumed = world.resume()
    result = resumed.cancel("stop")
    assert result.phase is Phase.NEEDS_REVIEW
    assert resumed.state.trace[-1].outcome is TraceOutcome.REVIEW_OPENED
    assert resumed.state.pending is not None  # the evidence stays


def test_a_run_under_review_is_not_cancelled(world: World) -> None:
    engine = world.start()
    plant_foreign_receipt(world, "fix-1")
    engine.propose(world.write(engine, key="fix-1"))
    generation = engine.generation
    with pytest.raises(InvalidTransitionError):
        engine.cancel("stop")
    assert engine.generation == generation and engine.state.phase is Phase.NEEDS_REVIEW


def test_a_cancel_restores_past_a_changed_environment_and_records_it(world: World) -> None:
    engine = world.start()
    engine.propose(world.order(engine))
    world.adapter.external_edit("app.py", "edited by a human\n")
    with pytest.raises(CheckpointError):
        world.resume()
    store = world.store.leased(3)
    store.claim(world.run_id)
    resumed = RunEngine.resume(
        engine.checkpoint, lease_version=3, tolerate_environment=True, **world.ports(store=store)
    )
    assert resumed.environment_refused is not None
    resumed.cancel("workspace edited", by="olga")
    detail = cancel_detail(resumed)
    assert detail["env_version_now"] == world.adapter.version
    assert resumed.state.environment == engine.state.environment  # the recorded one stays


# --- rebaseline ----------------------------------------------------------------------------


@pytest.fixture
def edited(world: World) -> RunEngine:
    """A run waiting for approval whose workspace a human edited: every restore fails."""
    engine = world.start()
    engine.propose(world.order(engine))
    assert engine.state.phase is Phase.AWAITING_APPROVAL
    world.adapter.external_edit("app.py", "edited by a human\n")
    with pytest.raises(CheckpointError):
        world.resume()
    return engine


def rebased(world: World, engine: RunEngine, **decision: object) -> RunEngine:
    signed = world.rebaseline(engine, **decision)  # type: ignore[arg-type]
    # As a worker does: the decision is checked against the opened checkpoint before its
    # environment is accepted by the restore.
    check_rebaseline(
        engine.state, world.scenario, signed, world.reviewers, generation=engine.generation
    )
    store = world.store.leased(3)
    store.claim(world.run_id)
    resumed = RunEngine.resume(
        engine.checkpoint,
        lease_version=3,
        accept_environment=decision_baseline(signed),
        **world.ports(store=store),
    )
    resumed.apply_rebaseline(signed)
    return resumed


def test_a_rebaseline_accepts_the_observed_environment_and_voids_old_approvals(
    world: World, edited: RunEngine
) -> None:
    old_env = edited.state.environment
    old_approval = world.approve(edited)  # signed against the old state
    resumed = rebased(world, edited)
    state = resumed.state
    assert state.phase is Phase.RUNNING and state.pending is None
    assert state.environment == world.adapter.observe()
    event = state.trace[-1]
    assert event.outcome is TraceOutcome.REBASELINED
    assert event.detail["old_env_fingerprint"] == old_env.fingerprint
    assert event.detail["new_env_fingerprint"] == state.environment.fingerprint
    assert event.detail["dropped_key"] == "order-1"
    with pytest.raises(ApprovalError):
        resumed.refresh_pending_approval(old_approval)  # nothing it could bind to
    # The agent proposes again from the new baseline; the write needs a fresh approval.
    resumed.propose(world.order(resumed))
    assert resumed.state.phase is Phase.AWAITING_APPROVAL
    with pytest.raises(ApprovalError):
        resumed.refresh_pending_approval(old_approval)
    resumed.refresh_pending_approval(world.approve(resumed))
    assert world.adapter.write_count == 1
    # And the rebased state restores from here on, its decision verified.
    assert world.resume(lease_version=4).state.environment == resumed.state.environment


@pytest.mark.parametrize(
    "bad",
    [
        {"reviewer_id": "mallory"},
        {"generation": 1},
        {"old_env_version": 99},
        {"run_id": "run-2"},
        {"new_env_instance_id": "ws-other"},
    ],
)
def test_a_rebaseline_bound_to_anything_else_is_refused(
    world: World, edited: RunEngine, bad: dict[str, object]
) -> None:
    with pytest.raises(ReviewDecisionError):
        rebased(world, edited, **bad)


def test_a_rebaseline_signed_before_another_edit_is_refused(
    world: World, edited: RunEngine
) -> None:
    signed = world.rebaseline(edited)
    world.adapter.external_edit("app.py", "edited again\n")
    store = world.store.leased(3)
    store.claim(world.run_id)
    with pytest.raises(CheckpointError):  # the decision does not name what is there now
        RunEngine.resume(
            edited.checkpoint,
            lease_version=3,
            accept_environment=decision_baseline(signed),
            **world.ports(store=store),
        )


def test_a_rebaseline_nonce_is_used_once(world: World, edited: RunEngine) -> None:
    signed = world.rebaseline(edited)
    resumed = rebased(world, edited, nonce=signed.claims.nonce)
    with pytest.raises(ReviewDecisionError) as err:
        resumed.apply_rebaseline(world.rebaseline(resumed, nonce=signed.claims.nonce))
    assert err.value.reason == "replayed_nonce"


def test_a_rebaseline_refuses_a_write_that_may_have_landed(world: World) -> None:
    old = world.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    with pytest.raises(SimulatedCrash):
        old.propose(world.write(old, key="fix-1"))
    signed = world.rebaseline(old)
    store = world.store.leased(3)
    store.claim(world.run_id)
    resumed = RunEngine.resume(
        old.checkpoint,
        lease_version=3,
        accept_environment=decision_baseline(signed),
        **world.ports(store=store),
    )
    generation = resumed.generation
    with pytest.raises(ReviewDecisionError) as err:
        resumed.apply_rebaseline(signed)
    assert err.value.reason == "pending_write_landed"
    assert resumed.generation == generation


def test_a_checkpoint_holding_a_rebaseline_needs_the_reviewer_trust_root(
    world: World, edited: RunEngine
) -> None:
    resumed = rebased(world, edited)
    store = world.store.leased(4)
    store.claim(world.run_id)
    with pytest.raises(CheckpointError) as err:
        RunEngine.resume(
            resumed.checkpoint, lease_version=4, **world.ports(store=store, reviewers=None)
        )
    assert err.value.reason == "trust"
