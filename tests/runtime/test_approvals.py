"""Exact approvals: signed, bound to everything that matters, one-time, expiring, and an
expired approval stays visible but never executes until a fresh exact one arrives."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.errors import ApprovalError, InvalidTransitionError
from ratchet.runtime import Phase, RunEngine, TraceOutcome
from tests.runtime.world import World


@pytest.fixture
def waiting(world: World) -> RunEngine:
    engine = world.start()
    result = engine.propose(world.order(engine))
    assert result.outcome is TraceOutcome.AWAITING_APPROVAL
    return engine


def test_a_write_that_needs_approval_waits_visibly_and_calls_no_adapter(
    world: World, waiting: RunEngine
) -> None:
    assert waiting.state.phase is Phase.AWAITING_APPROVAL
    assert waiting.state.pending is not None
    assert world.adapter.write_count == 0
    with pytest.raises(InvalidTransitionError):
        waiting.execute_pending()
    assert (
        waiting.propose(world.action(waiting, "read_file", {"path": "app.py"})).outcome
        is TraceOutcome.REJECTED_PHASE
    )


def test_an_exact_trusted_approval_executes_once_and_binds_the_receipt(
    world: World, waiting: RunEngine
) -> None:
    evidence = world.approve(waiting)
    result = waiting.refresh_pending_approval(evidence)
    assert result.outcome is TraceOutcome.EXECUTED
    assert world.adapter.write_count == 1
    receipt = waiting.state.executed[-1].receipt
    assert receipt.approval_digest == evidence.digest
    assert evidence.claims.nonce in waiting.state.consumed_nonces
    assert evidence.claims.nonce in world.store.nonces


def test_an_approval_can_come_with_the_proposal(world: World) -> None:
    engine = world.start()
    action = world.order(engine)
    # An operator signs against the state the agent planned on: here, before the pending
    # write exists, so the pending fields are those of the action itself.
    state = engine.state
    from ratchet.runtime import ApprovalClaims, sign_approval

    claims = ApprovalClaims(
        task_id=state.task_id,
        run_id=state.run_id,
        policy_id=state.policy_id,
        policy_version=state.policy_version,
        action_id=action.action_id,
        idempotency_key=action.idempotency_key or "",
        intent_digest=action.intent_digest,
        env_instance_id=state.environment.instance_id,
        env_fingerprint=state.environment.fingerprint,
        env_version=state.environment.version,
        generation=engine.generation,
        nonce="n-pre",
        expires_at=world.clock.now() + 60,
        max_proposals=5,
    )
    result = engine.propose(action, approval=sign_approval(world.approver_key, "alice", claims))
    assert result.outcome is TraceOutcome.EXECUTED
    assert world.adapter.write_count == 1


BINDINGS: list[tuple[str, Any]] = [
    ("task_id", "other-task"),
    ("run_id", "run-2"),
    ("policy_id", "strict"),
    ("policy_version", "1"),
    ("action_id", "a-other"),
    ("idempotency_key", "order-2"),
    ("intent_digest", "f" * 64),
    ("env_instance_id", "ws-b"),
    ("env_fingerprint", "e" * 64),
    ("env_version", 7),
    ("generation", 1),
]


@pytest.mark.parametrize(("field", "value"), BINDINGS)
def test_an_approval_bound_to_anything_else_is_refused(
    world: World, waiting: RunEngine, field: str, value: Any
) -> None:
    generation = waiting.generation
    with pytest.raises(ApprovalError) as err:
        waiting.refresh_pending_approval(world.approve(waiting, **{field: value}))
    assert err.value.reason == "binding"
    assert waiting.state.phase is Phase.AWAITING_APPROVAL
    assert waiting.generation == generation
    assert world.adapter.write_count == 0


def test_an_untrusted_approver_is_refused(world: World, waiting: RunEngine) -> None:
    with pytest.raises(ApprovalError) as err:
        waiting.refresh_pending_approval(world.approve(waiting, key=Ed25519PrivateKey.generate()))
    assert err.value.reason == "bad_signature"


def test_a_tampered_approval_signature_is_refused(world: World, waiting: RunEngine) -> None:
    evidence = world.approve(waiting)
    tampered = evidence.model_copy(
        update={
            "claims": evidence.claims.model_copy(
                update={"expires_at": evidence.claims.expires_at + 10_000}
            )
        }
    )
    with pytest.raises(ApprovalError) as err:
        waiting.refresh_pending_approval(tampered)
    assert err.value.reason == "bad_signature"


def test_a_reviewer_key_cannot_sign_an_approval(world: World, waiting: RunEngine) -> None:
    with pytest.raises(ApprovalError):
        waiting.refresh_pending_approval(world.approve(waiting, key=world.reviewer_key))


def test_an_approval_nonce_is_consumed_once(world: World, waiting: RunEngine) -> None:
    evidence = world.approve(waiting)
    waiting.refresh_pending_approval(evidence)
    waiting.propose(world.order(waiting, key="order-2", body='{"sku":"B"}'))
    replay = world.approve(waiting, nonce=evidence.claims.nonce)
    with pytest.raises(ApprovalError) as err:
        waiting.refresh_pending_approval(replay)
    assert err.value.reason == "replayed_nonce"


def test_an_already_expired_approval_is_refused(world: World, waiting: RunEngine) -> None:
    with pytest.raises(ApprovalError) as err:
        waiting.refresh_pending_approval(world.approve(waiting, ttl=-1))
    assert err.value.reason == "expired"


def test_an_approved_pending_write_whose_approval_expired_restores_visible_and_frozen(
    world: World, waiting: RunEngine
) -> None:
    old = world.approve(waiting, ttl=30)
    waiting.refresh_pending_approval(old, execute=False)  # committed, then the worker died
    world.clock.advance(31)

    engine = world.resume()  # the expired evidence is not a checkpoint failure
    assert engine.state.pending is not None
    assert engine.state.pending.approval == old  # visible to an operator
    engine.reconcile()
    assert engine.state.phase is Phase.AWAITING_APPROVAL
    assert engine.state.trace[-1].outcome is TraceOutcome.APPROVAL_EXPIRED
    assert world.adapter.write_count == 0
    with pytest.raises(InvalidTransitionError):
        engine.execute_pending()

    fresh = world.approve(engine)
    assert engine.refresh_pending_approval(fresh).outcome is TraceOutcome.EXECUTED
    assert world.adapter.write_count == 1
    sealed = [
        e.sealed_approval
        for e in engine.state.trace
        if e.outcome is TraceOutcome.APPROVAL_REFRESHED
    ]
    assert old in sealed  # the superseded evidence is kept in the trace


def test_an_approval_expires_by_proposal_count_too(world: World, waiting: RunEngine) -> None:
    evidence = world.approve(waiting, max_proposals=waiting.state.usage.proposals)
    waiting.refresh_pending_approval(evidence, execute=False)
    # One more proposal (rejected: a write is pending) pushes usage past the cap.
    waiting.propose(world.action(waiting, "read_file", {"path": "app.py"}))
    waiting.execute_pending()
    assert waiting.state.phase is Phase.AWAITING_APPROVAL
    assert world.adapter.write_count == 0


def test_a_receipt_that_does_not_bind_the_approval_opens_a_review(
    world: World, waiting: RunEngine
) -> None:
    real_execute = world.adapter.execute

    def unbound(action: Any, intent: str, fence: Any, approval: str | None) -> Any:
        return real_execute(action, intent, fence, None)  # adapter ignores the approval

    world.adapter.execute = unbound  # type: ignore[method-assign]
    waiting.refresh_pending_approval(world.approve(waiting))
    assert waiting.state.phase is Phase.NEEDS_REVIEW
    assert waiting.state.review is not None
    assert waiting.state.review.reason.value == "approval_unbound"


def test_restoring_approval_evidence_needs_the_approver_trust_root(
    world: World, waiting: RunEngine
) -> None:
    from ratchet.errors import CheckpointError
    from ratchet.runtime import RunEngine as Engine

    waiting.refresh_pending_approval(world.approve(waiting), execute=False)
    ports = world.ports(approvers=None)
    with pytest.raises(CheckpointError) as err:
        Engine.resume(waiting.checkpoint, **ports)
    assert err.value.reason == "trust"


def test_a_revoked_approvers_executed_approval_does_not_strand_the_checkpoint(
    world: World, waiting: RunEngine
) -> None:
    """Sealed evidence was verified when it was used; a later revocation does not unmake
    it (the run restores, with the evidence visible)."""
    from ratchet.runtime import TrustRoots
    from tests.runtime.world import public_bytes

    waiting.refresh_pending_approval(world.approve(waiting))
    assert world.adapter.write_count == 1
    revoked = TrustRoots.from_public_bytes(
        "approver", {"alice": public_bytes(world.approver_key)}, frozenset({"alice"})
    )
    resumed = RunEngine.resume(
        waiting.checkpoint, **world.ports(approvers=revoked, store=world.store.leased(2))
    )
    assert resumed.state.executed[-1].receipt.approval_digest is not None


def test_a_pending_write_approved_by_a_since_revoked_approver_never_executes(
    world: World, waiting: RunEngine
) -> None:
    from ratchet.runtime import TrustRoots
    from tests.runtime.world import public_bytes

    waiting.refresh_pending_approval(world.approve(waiting), execute=False)
    revoked = TrustRoots.from_public_bytes(
        "approver", {"alice": public_bytes(world.approver_key)}, frozenset({"alice"})
    )
    store = world.store.leased(2)
    store.claim(world.run_id)
    resumed = RunEngine.resume(
        waiting.checkpoint, lease_version=2, **world.ports(approvers=revoked, store=store)
    )
    resumed.reconcile()
    assert resumed.state.phase is Phase.AWAITING_APPROVAL
    assert resumed.state.trace[-1].detail["reason"] == "approver revoked"
    assert world.adapter.write_count == 0
