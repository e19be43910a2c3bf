"""Effect outcomes: what a write's result, a read or a verifier report means for the run.

Receipts (recorded, completed, replayed), execution errors, the review case a result
that cannot be explained opens, reads and verification. Pure functions like
:mod:`ratchet.runtime.machine`, imported from here: the caller passes in what it observed
and gets a new state back, with one trace event appended. What a person decides about a
run (review decisions, cancellation, rebaselining) is :mod:`ratchet.runtime.decisions`.
"""

from __future__ import annotations

from typing import Any

from ratchet.errors import (
    EnvironmentMismatchError,
    InvalidTransitionError,
)
from ratchet.runtime.actions import Action
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.history import grow
from ratchet.runtime.ports import Observation, ReadResult, Receipt, VerifierReport
from ratchet.runtime.state import (
    Event,
    ExecutedWrite,
    ReviewCase,
    ReviewReason,
    RunState,
    TraceOutcome,
    transition,
)
from ratchet.runtime.tracing import append_event as _with
from ratchet.runtime.tracing import make_event as _event

__all__ = [
    "apply_read",
    "apply_verification",
    "complete_write",
    "open_review",
    "record_execution_error",
    "record_receipt",
    "record_replay",
]


# --- receipts ------------------------------------------------------------------------------


def open_review(
    state: RunState,
    reason: ReviewReason,
    receipt: Receipt | None,
    *,
    now: int,
    detail: str = "",
    observed: Observation | None = None,
) -> RunState:
    """Freeze the run in ``needs_review``, keeping the pending write and the receipt.

    ``observed`` is the environment as observed when the case opens (the engine observes
    first). The case records it: a reviewer signs a decision bound to that environment,
    and the decision is consumed only while the environment still reads the same. A
    foreign write that caused the case usually moved the environment past the run's last
    observation, so recording ``state.environment`` instead would make every decision
    fail as ``environment_changed``. Without an observation the case records the run's
    last one.
    """
    pending = state.pending
    if pending is None:
        raise InvalidTransitionError("a review case needs a pending write")
    case = ReviewCase(
        case_id=f"case-{state.next_seq}",
        reason=reason,
        pending=pending,
        receipt=receipt,
        receipt_fingerprint=receipt.fingerprint if receipt is not None else None,
        environment=observed if observed is not None else state.environment,
        opened_seq=state.next_seq,
    )
    info: dict[str, Any] = {"reason": reason.value, "case_id": case.case_id}
    if receipt is not None:
        info |= {
            "receipt_intent_digest": receipt.intent_digest,
            "receipt_fingerprint": case.receipt_fingerprint or "",
        }
    if detail:
        info["detail"] = detail[:1024]
    if case.environment is not state.environment:
        info |= {
            "env_version": case.environment.version,
            "env_fingerprint": case.environment.fingerprint,
        }
    event = _event(state, now, TraceOutcome.REVIEW_OPENED, action=pending.action, detail=info)
    return _with(state, event, phase=transition(state.phase, Event.REVIEW_OPENED), review=case)


def record_receipt(
    state: RunState,
    receipt: Receipt,
    *,
    now: int,
    traced: bool = True,
    observed: Observation | None = None,
) -> RunState:
    """Attach the adapter's receipt to the pending write (before the state advances).

    A receipt for another intent, or one that does not bind the pending approval (or was
    committed after that approval expired), opens a review case instead, recording
    ``observed`` (see :func:`open_review`). ``traced=False`` leaves out the
    ``receipt_recorded`` event, for a caller that commits the receipt together with
    :func:`complete_write` (whose event names the receipt).
    """
    pending = state.pending
    if pending is None or pending.receipt is not None:
        raise InvalidTransitionError("no pending write is waiting for a receipt")
    action = pending.action
    if receipt.idempotency_key != action.idempotency_key:
        return open_review(
            state,
            ReviewReason.RECEIPT_DRIFT,
            receipt,
            now=now,
            detail="receipt names another idempotency key",
            observed=observed,
        )
    if receipt.intent_digest != pending.intent_digest:
        return open_review(state, ReviewReason.INTENT_CONFLICT, receipt, now=now, observed=observed)
    approval = pending.approval
    if approval is not None and (
        receipt.approval_digest != approval.digest
        or receipt.committed_at > approval.claims.expires_at
    ):
        return open_review(
            state,
            ReviewReason.APPROVAL_UNBOUND,
            receipt,
            now=now,
            detail="receipt does not bind the approval or postdates its expiry",
            observed=observed,
        )
    with_receipt = pending.model_copy(update={"receipt": receipt})
    if not traced:
        return state.model_copy(update={"pending": with_receipt})
    event = _event(
        state,
        now,
        TraceOutcome.RECEIPT_RECORDED,
        action=action,
        detail={"receipt_id": receipt.receipt_id, "receipt_fingerprint": receipt.fingerprint},
    )
    return _with(state, event, pending=with_receipt)


def complete_write(
    state: RunState,
    observed: Observation,
    *,
    now: int,
    outcome: TraceOutcome = TraceOutcome.EXECUTED,
) -> RunState:
    """Advance the state after a recorded receipt: the deterministic transition.

    The adapter's receipt is authoritative, the runtime's cache of executed writes only a
    copy. When the environment is still exactly the write's "before" state, the receipt
    cannot come from a write made now (that would have moved the environment): the
    adapter answered with an earlier effect of the same key and intent, one the cache
    does not hold (lost, or made outside this run). That is a replay: the cache entry is
    rebuilt from the receipt, the environment and the verification stay as they are, and
    nothing is written twice.

    Raises:
        EnvironmentMismatchError: the environment is neither the write's one-commit state
            nor its unchanged "before" state.
    """
    pending = state.pending
    if pending is None or pending.receipt is None:
        raise InvalidTransitionError("no recorded receipt to apply")
    receipt = pending.receipt
    if observed.instance_id != state.environment.instance_id:
        raise EnvironmentMismatchError(
            "environment instance changed",
            expected=state.environment.instance_id,
            observed=observed.instance_id,
        )
    expected = pending.env_after
    fresh = (
        observed.same_state(expected)
        if expected is not None
        else observed.version == receipt.env_version_after
    )
    entry = ExecutedWrite(
        action_id=pending.action.action_id,
        idempotency_key=receipt.idempotency_key,
        intent_digest=receipt.intent_digest,
        receipt=receipt,
        receipt_fingerprint=receipt.fingerprint,
    )
    if not fresh and observed.same_state(pending.env_before):
        event = _event(
            state,
            now,
            TraceOutcome.REPLAYED,
            action=pending.action,
            detail={
                "receipt_id": receipt.receipt_id,
                "receipt_fingerprint": entry.receipt_fingerprint,
                "rebuilt_from": "adapter_receipt",
            },
        )
        return _with(
            state,
            event,
            pending=None,
            executed=grow(state.executed, entry),
            plan_cursor=state.plan_cursor + 1,
        )
    if not fresh and expected is not None:
        raise EnvironmentMismatchError(
            "environment is not the pending write's one-commit state",
            expected_version=expected.version,
            observed_version=observed.version,
        )
    if not fresh:
        raise EnvironmentMismatchError(
            "environment version differs from the receipt's",
            expected_version=receipt.env_version_after,
            observed_version=observed.version,
        )
    moved = state.model_copy(update={"environment": observed})
    event = _event(
        moved,
        now,
        outcome,
        action=pending.action,
        detail={"receipt_id": receipt.receipt_id, "receipt_fingerprint": entry.receipt_fingerprint},
    )
    return _with(
        moved,
        event,
        pending=None,
        executed=grow(state.executed, entry),
        last_write_env_version=observed.version,
        verification=None,
        plan_cursor=state.plan_cursor + 1,
    )


def record_replay(
    state: RunState, authoritative: Receipt | None, *, now: int, observed: Observation | None = None
) -> RunState:
    """Check a cached key's replay against the adapter's receipt.

    Only an authoritative receipt identical in every field to the cached one is a replay;
    a missing receipt or any drift (namespace, version, id, digest, result) opens a review
    recording ``observed`` (see :func:`open_review`).
    """
    pending = state.pending
    if pending is None or pending.replay_of is None:
        raise InvalidTransitionError("the pending write is not a replay")
    if authoritative is None:
        return open_review(
            state,
            ReviewReason.RECEIPT_MISSING,
            None,
            now=now,
            detail="the adapter has no receipt for a cached key",
            observed=observed,
        )
    if authoritative.fingerprint != pending.replay_of:
        reason = (
            ReviewReason.INTENT_CONFLICT
            if authoritative.intent_digest != pending.intent_digest
            else ReviewReason.RECEIPT_DRIFT
        )
        return open_review(
            state,
            reason,
            authoritative,
            now=now,
            detail="the adapter's receipt differs from the cached copy",
            observed=observed,
        )
    event = _event(
        state,
        now,
        TraceOutcome.REPLAYED,
        action=pending.action,
        detail={"receipt_id": authoritative.receipt_id},
    )
    return _with(state, event, pending=None, plan_cursor=state.plan_cursor + 1)


def record_execution_error(state: RunState, message: str, *, now: int, fatal: bool) -> RunState:
    """The adapter refused the pending write for good, with no effect: drop it.

    ``fatal`` ends the run in ``failed``; otherwise the agent may plan again.
    """
    pending = state.pending
    if pending is None or pending.receipt is not None:
        raise InvalidTransitionError("no unexecuted pending write to drop")
    event = _event(
        state,
        now,
        TraceOutcome.EXECUTION_ERROR,
        action=pending.action,
        detail={"error": message[:1024], "fatal": int(fatal)},
    )
    changes: dict[str, Any] = {"pending": None}
    if fatal:
        changes |= {
            "phase": transition(state.phase, Event.FATAL_ERROR),
            "stop_reason": f"execution error: {message[:200]}",
        }
    return _with(state, event, **changes)


# --- reads and verification ---------------------------------------------------------------


def apply_read(state: RunState, action: Action, result: ReadResult, *, now: int) -> RunState:
    """Record a read (its content digest, not its content)."""
    event = _event(
        state,
        now,
        TraceOutcome.READ,
        action=action,
        detail={
            "path": action.args.get("path", ""),
            "content_digest": digest(Domain.ENVIRONMENT, result.content),
        },
    )
    return _with(state, event, plan_cursor=state.plan_cursor + 1)


def apply_verification(
    state: RunState, action: Action, report: VerifierReport, *, now: int
) -> RunState:
    """Record a verifier report bound to the current environment.

    Raises:
        EnvironmentMismatchError: the report was made against another state.
    """
    env = state.environment
    if (report.env_instance_id, report.env_version, report.env_fingerprint) != (
        env.instance_id,
        env.version,
        env.fingerprint,
    ):
        raise EnvironmentMismatchError(
            "verifier ran against another environment state",
            expected_version=env.version,
            observed_version=report.env_version,
        )
    event = _event(
        state,
        now,
        TraceOutcome.VERIFIED,
        action=action,
        detail={"passed": int(report.passed), "target": report.target},
        verifier=report,
    )
    return _with(state, event, verification=report, plan_cursor=state.plan_cursor + 1)
