"""Review cases stay frozen until a trusted, exactly bound, fresh reviewer decision, and
the authoritative receipt reads the same when the decision is consumed."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.errors import CheckpointError, ReviewDecisionError
from ratchet.runtime import Phase, Receipt, RunEngine, TraceOutcome
from tests.runtime.world import World, plant_foreign_receipt


@pytest.fixture
def frozen(world: World) -> RunEngine:
    engine = world.start()
    plant_foreign_receipt(world, "fix-1")
    engine.propose(world.write(engine, key="fix-1"))
    assert engine.state.phase is Phase.NEEDS_REVIEW
    return engine


def assert_still_frozen(engine: RunEngine, generation: int) -> None:
    assert engine.state.phase is Phase.NEEDS_REVIEW
    assert engine.generation == generation
    assert engine.state.review is not None and engine.state.pending is not None


def test_an_unknown_reviewer_keeps_the_case_frozen(world: World, frozen: RunEngine) -> None:
    generation = frozen.generation
    decision = world.decide(frozen, "replan", reviewer_id="mallory")
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(decision)
    assert err.value.reason == "unknown_signer"
    assert_still_frozen(frozen, generation)


def test_a_decision_signed_by_an_untrusted_key_keeps_the_case_frozen(
    world: World, frozen: RunEngine
) -> None:
    generation = frozen.generation
    with pytest.raises(ReviewDecisionError):
        frozen.apply_review_decision(
            world.decide(frozen, "replan", key=Ed25519PrivateKey.generate())
        )
    with pytest.raises(ReviewDecisionError):  # approvers are a different trust root
        frozen.apply_review_decision(world.decide(frozen, "replan", key=world.approver_key))
    assert_still_frozen(frozen, generation)


def test_a_tampered_decision_keeps_the_case_frozen(world: World, frozen: RunEngine) -> None:
    decision = world.decide(frozen, "replan")
    from ratchet.runtime import ReviewVerdict

    flipped = decision.model_copy(
        update={"claims": decision.claims.model_copy(update={"verdict": ReviewVerdict.ABORT})}
    )
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(flipped)
    assert err.value.reason == "bad_signature"
    assert_still_frozen(frozen, frozen.generation)


def test_an_environment_change_after_signing_keeps_the_case_frozen(
    world: World, frozen: RunEngine
) -> None:
    decision = world.decide(frozen, "replan")
    world.adapter.external_edit("app.py", "print('changed')\n")
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(decision)
    assert err.value.reason == "environment_changed"
    assert_still_frozen(frozen, frozen.generation)


@pytest.mark.parametrize(
    "drift",
    [
        {"receipt_id": "rcpt-x"},
        {"result": {"path": "other"}},
        {"namespace": "ns-2"},
        {"receipt_version": 3},
    ],
)
def test_receipt_drift_after_signing_keeps_the_case_frozen(
    world: World, frozen: RunEngine, drift: dict[str, Any]
) -> None:
    decision = world.decide(frozen, "replan")
    world.adapter.replace_receipt("fix-1", **drift)
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(decision)
    assert err.value.reason == "receipt_drift"
    assert_still_frozen(frozen, frozen.generation)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("task_id", "t2"),
        ("run_id", "run-9"),
        ("policy_version", "1"),
        ("case_id", "case-1"),
        ("action_id", "a-9"),
        ("idempotency_key", "fix-9"),
        ("pending_intent_digest", "c" * 64),
        ("receipt_intent_digest", "d" * 64),
        ("receipt_fingerprint", "e" * 64),
        ("env_instance_id", "ws-b"),
        ("env_version", 99),
    ],
)
def test_a_decision_bound_to_anything_else_keeps_the_case_frozen(
    world: World, frozen: RunEngine, field: str, value: Any
) -> None:
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(world.decide(frozen, "replan", **{field: value}))
    # A version the environment never reached is one it does not read now.
    assert err.value.reason == ("environment_changed" if field == "env_version" else "binding")
    assert_still_frozen(frozen, frozen.generation)


def test_a_decision_bound_to_an_environment_older_than_the_case_is_refused(
    world: World, frozen: RunEngine
) -> None:
    case = frozen.state.review
    assert case is not None
    older = world.decide(frozen, "replan", env_version=case.environment.version - 1)
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(older)
    assert (err.value.reason, err.value.field) == ("binding", "env_version")


def test_a_decision_signed_after_a_person_edited_the_waiting_workspace_applies(
    world: World, frozen: RunEngine
) -> None:
    """The case recorded one environment; a person edited the workspace while the run
    waited. A decision signed for the environment as it is now is consumed (one signed for
    the case's environment is not: the environment moved after it)."""
    stale = world.decide(frozen, "abort")
    world.adapter.external_edit("docs/note.md", "a person's note\n")
    with pytest.raises(ReviewDecisionError) as err:
        frozen.apply_review_decision(stale)
    assert err.value.reason == "environment_changed"
    fresh = world.decide(frozen, "abort", env_version=world.adapter.observe().version)
    assert frozen.apply_review_decision(fresh).phase is Phase.FAILED


def test_a_replayed_decision_nonce_is_refused(world: World) -> None:
    engine = world.start()
    plant_foreign_receipt(world, "fix-1")
    engine.propose(world.write(engine, key="fix-1"))
    first = world.decide(engine, "replan")
    engine.apply_review_decision(first)
    plant_foreign_receipt(world, "fix-2")
    engine.propose(world.write(engine, key="fix-2"))
    with pytest.raises(ReviewDecisionError) as err:
        engine.apply_review_decision(world.decide(engine, "replan", nonce=first.claims.nonce))
    assert err.value.reason == "replayed_nonce"


def test_a_trusted_replan_quarantines_the_key_and_completes_with_a_new_one(
    world: World, frozen: RunEngine
) -> None:
    result = frozen.apply_review_decision(world.decide(frozen, "replan"))
    assert result.outcome is TraceOutcome.REVIEW_REPLANNED
    state = frozen.state
    assert state.phase is Phase.RUNNING
    assert "fix-1" in state.quarantined_keys
    sealed = state.closed_reviews[-1]
    assert sealed.decision is not None and sealed.receipt is not None
    assert sealed.pending.action.idempotency_key == "fix-1"
    assert (
        frozen.propose(world.write(frozen, key="fix-1")).outcome
        is TraceOutcome.REJECTED_KEY_QUARANTINED
    )
    assert frozen.propose(world.write(frozen, key="fix-1b")).outcome is TraceOutcome.EXECUTED
    assert frozen.propose(world.verify(frozen)).outcome is TraceOutcome.VERIFIED
    assert frozen.propose(world.finish(frozen)).phase is Phase.COMPLETED
    assert world.adapter.write_count == 1
    restored = world.resume()  # evidence round-trips through a signed checkpoint
    assert restored.state.closed_reviews == state.closed_reviews


def test_a_trusted_abort_fails_the_run_and_keeps_all_evidence(
    world: World, frozen: RunEngine
) -> None:
    case = frozen.state.review
    decision = world.decide(frozen, "abort")
    result = frozen.apply_review_decision(decision)
    assert result.phase is Phase.FAILED
    sealed = frozen.state.closed_reviews[-1]
    assert case is not None
    assert sealed.pending == case.pending
    assert sealed.receipt == case.receipt
    assert sealed.decision == decision
    restored = world.resume()
    assert restored.state.phase is Phase.FAILED
    assert restored.state.closed_reviews[-1] == sealed


def test_restoring_review_evidence_needs_the_reviewer_trust_root(
    world: World, frozen: RunEngine
) -> None:
    frozen.apply_review_decision(world.decide(frozen, "abort"))
    with pytest.raises(CheckpointError) as err:
        RunEngine.resume(frozen.checkpoint, **world.ports(reviewers=None))
    assert err.value.reason == "trust"


# --- a conflict whose foreign write moved the environment ---------------------------------


def plant_foreign_write(world: World, key: str) -> Receipt:
    """Another caller wrote under ``key`` for another intent, as a real foreign write does:
    the adapter holds its receipt and the environment moved on (a new version)."""
    world.adapter.external_edit("docs/foreign.md", "written by another caller\n")
    receipt = Receipt(
        namespace=world.adapter.namespace,
        receipt_version=1,
        receipt_id="rcpt-foreign",
        idempotency_key=key,
        intent_digest="a" * 64,
        result={"path": "docs/foreign.md"},
        committed_at=world.clock.now(),
        env_version_after=world.adapter.version,
    )
    world.adapter.plant_receipt(receipt)
    return receipt


@pytest.fixture(params=["engine-checks-preconditions", "adapter-checks-preconditions"])
def moved(request: pytest.FixtureRequest, world: World) -> RunEngine:
    """A run frozen by a conflict whose foreign write moved the version. Both ways into
    the case: the engine's live precondition check finds the receipt, or (for an adapter
    that declares it checks preconditions itself) the adapter reports the conflict."""
    if request.param == "adapter-checks-preconditions":
        world.adapter.enforces_preconditions = True  # type: ignore[attr-defined]
    engine = world.start()
    plant_foreign_write(world, "fix-1")
    engine.propose(world.write(engine, key="fix-1"))
    assert engine.state.phase is Phase.NEEDS_REVIEW
    return engine


def test_a_conflict_case_records_the_environment_observed_when_it_opened(
    world: World, moved: RunEngine
) -> None:
    case = moved.state.review
    assert case is not None
    assert case.environment == world.adapter.observe()
    assert case.environment.version == moved.state.environment.version + 1
    assert world.adapter.write_count == 0


def test_a_trusted_replan_resolves_a_conflict_whose_foreign_write_moved_the_version(
    world: World, moved: RunEngine
) -> None:
    case = moved.state.review
    result = moved.apply_review_decision(world.decide(moved, "replan"))
    assert result.outcome is TraceOutcome.REVIEW_REPLANNED
    state = moved.state
    assert state.phase is Phase.RUNNING
    assert "fix-1" in state.quarantined_keys
    assert state.closed_reviews[-1].pending == case.pending  # type: ignore[union-attr]
    assert state.closed_reviews[-1].receipt == case.receipt  # type: ignore[union-attr]
    assert state.environment == world.adapter.observe()
    assert moved.propose(world.write(moved, key="fix-1b")).outcome is TraceOutcome.EXECUTED
    assert moved.propose(world.verify(moved)).outcome is TraceOutcome.VERIFIED
    assert moved.propose(world.finish(moved)).phase is Phase.COMPLETED
    assert world.adapter.write_count == 1


def test_a_trusted_abort_ends_a_conflict_whose_foreign_write_moved_the_version(
    world: World, moved: RunEngine
) -> None:
    case = moved.state.review
    decision = world.decide(moved, "abort")
    assert moved.apply_review_decision(decision).phase is Phase.FAILED
    sealed = moved.state.closed_reviews[-1]
    assert case is not None and sealed.pending == case.pending
    assert sealed.receipt == case.receipt and sealed.decision == decision
    assert world.resume().state.closed_reviews[-1] == sealed
    assert world.adapter.write_count == 0


def test_a_checkpoint_holding_an_open_case_restores_and_its_decision_applies_there(
    world: World, moved: RunEngine
) -> None:
    """What a worker does: the run was released while frozen; a later job restores the
    checkpoint (the environment is the one the case recorded, not the run's last) and
    consumes the decision from the inbox."""
    decision = world.decide(moved, "replan")
    resumed = world.resume(moved.checkpoint)
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert resumed.reconcile().window is None
    assert resumed.apply_review_decision(decision).phase is Phase.RUNNING


def test_an_environment_that_moves_after_the_decision_still_keeps_the_moved_case_frozen(
    world: World, moved: RunEngine
) -> None:
    decision = world.decide(moved, "replan")
    world.adapter.external_edit("app.py", "print('changed again')\n")
    with pytest.raises(ReviewDecisionError) as err:
        moved.apply_review_decision(decision)
    assert err.value.reason == "environment_changed"
    assert_still_frozen(moved, moved.generation)
