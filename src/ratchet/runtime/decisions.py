"""Human decisions on a run: reviewer decisions, cancellation, rebaselining.

Each is a person's signed or attributed act, checked before it changes anything: an open
review case closed by a reviewer's verdict, a run cancelled at a safe point (its pending
write settled by the adapter's answer for the key, never dropped in an unknown state), the
environment as observed now made the run's baseline. Pure functions like
:mod:`ratchet.runtime.machine`: the caller passes in what it looked up and observed and
gets a new state back, with one trace event appended. What an effect's own result means
for the run is :mod:`ratchet.runtime.outcomes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ratchet.errors import (
    InvalidTransitionError,
    ReviewDecisionError,
)
from ratchet.runtime.evidence import (
    RebaselineDecision,
    ReviewDecision,
    ReviewVerdict,
    TrustRoots,
)
from ratchet.runtime.ports import Observation, Receipt
from ratchet.runtime.scenario import Scenario
from ratchet.runtime.state import (
    Event,
    ExecutedWrite,
    Phase,
    ReviewCase,
    RunState,
    TraceOutcome,
    transition,
)
from ratchet.runtime.tracing import append_event as _with
from ratchet.runtime.tracing import make_event as _event

__all__ = [
    "Settled",
    "apply_rebaseline",
    "apply_review_decision",
    "cancel",
    "check_rebaseline",
    "check_review_decision",
    "decision_baseline",
]


# --- review decisions and cancellation -------------------------------------------------------


def check_review_decision(
    state: RunState, scenario: Scenario, decision: ReviewDecision, reviewers: TrustRoots
) -> ReviewCase:
    """The checks on a decision that need no adapter: an open case, a trusted reviewer's
    valid signature, every binding, an unused nonce. Returns the open case.

    :func:`apply_review_decision` makes them again, then re-reads the world; an operator
    command makes them before posting a decision, so a bad one is refused at once.

    Raises:
        ReviewDecisionError: ``reason`` names the failed check.
    """
    case = state.review
    if state.phase is not Phase.NEEDS_REVIEW or case is None:
        raise ReviewDecisionError("no review case is open", reason="no_open_case")
    reviewers.verify_review(decision)
    c, action = decision.claims, case.pending.action
    bound = {
        "task_id": (c.task_id, scenario.task_id),
        "run_id": (c.run_id, state.run_id),
        "policy": ((c.policy_id, c.policy_version), (scenario.policy_id, scenario.policy_version)),
        "case_id": (c.case_id, case.case_id),
        "action_id": (c.action_id, action.action_id),
        "idempotency_key": (c.idempotency_key, action.idempotency_key),
        "pending_intent_digest": (c.pending_intent_digest, case.pending.intent_digest),
        "receipt_intent_digest": (
            c.receipt_intent_digest,
            case.receipt.intent_digest if case.receipt else None,
        ),
        "receipt_fingerprint": (c.receipt_fingerprint, case.receipt_fingerprint),
        "env_instance_id": (c.env_instance_id, case.environment.instance_id),
    }
    for name, (claimed, actual) in bound.items():
        if claimed != actual:
            raise ReviewDecisionError(
                f"decision is bound to another {name}", reason="binding", field=name
            )
    # The decision names the environment the reviewer saw when deciding: the one the case
    # recorded, or a later one (a person edited the workspace while the run waited); never
    # an earlier one. It applies only while the environment still reads that version.
    if c.env_version < case.environment.version:
        raise ReviewDecisionError(
            "decision is bound to an environment older than the case",
            reason="binding",
            field="env_version",
        )
    if c.nonce in state.consumed_nonces:
        raise ReviewDecisionError(
            "decision nonce was already consumed", reason="replayed_nonce", nonce=c.nonce
        )
    return case


def apply_review_decision(
    state: RunState,
    scenario: Scenario,
    decision: ReviewDecision,
    reviewers: TrustRoots,
    *,
    authoritative: Receipt | None,
    observed: Observation,
    now: int,
) -> RunState:
    """Consume a signed reviewer decision on the open case.

    ``authoritative`` is the adapter's receipt for the case's key, read again just now;
    ``observed`` is the environment observed just now. Any unknown reviewer, bad
    signature, binding mismatch, replayed nonce, environment change or receipt drift
    raises ReviewDecisionError and leaves the case frozen (the state is unchanged).
    """
    case = check_review_decision(state, scenario, decision, reviewers)
    c, action = decision.claims, case.pending.action
    if (observed.instance_id, observed.version) != (c.env_instance_id, c.env_version):
        raise ReviewDecisionError(
            "environment changed after the decision was signed", reason="environment_changed"
        )
    fresh = authoritative.fingerprint if authoritative is not None else None
    if fresh != case.receipt_fingerprint:
        raise ReviewDecisionError(
            "the authoritative receipt drifted since the case opened", reason="receipt_drift"
        )
    sealed = case.model_copy(update={"decision": decision})
    common: dict[str, Any] = {
        "review": None,
        "pending": None,
        "closed_reviews": (*state.closed_reviews, sealed),
        "consumed_nonces": (*state.consumed_nonces, c.nonce),
        "environment": observed,
    }
    detail = {"case_id": case.case_id, "reviewer_id": decision.reviewer_id}
    key = action.idempotency_key
    if c.verdict is ReviewVerdict.REPLAN:
        event = _event(state, now, TraceOutcome.REVIEW_REPLANNED, action=action, detail=detail)
        return _with(
            state,
            event,
            phase=transition(state.phase, Event.REVIEW_REPLAN),
            quarantined_keys=(*state.quarantined_keys, key),
            **common,
        )
    event = _event(state, now, TraceOutcome.REVIEW_ABORTED, action=action, detail=detail)
    return _with(
        state,
        event,
        phase=transition(state.phase, Event.REVIEW_ABORT),
        stop_reason=f"aborted by reviewer {decision.reviewer_id}",
        **common,
    )


@dataclass(frozen=True, slots=True)
class Settled:
    """What a lookup by key at the adapter said about a pending write, for :func:`cancel`
    and :func:`apply_rebaseline`: ``receipt`` is the adapter's authoritative receipt for
    the key (None: it has none)."""

    receipt: Receipt | None


def cancel(
    state: RunState,
    reason: str,
    *,
    now: int,
    by: str = "",
    request_id: str = "",
    settled: Settled | None = None,
    observed: Observation | None = None,
) -> RunState:
    """Cancel a running or waiting run at a safe point.

    A write only waiting for approval was never sent: it is dropped and the trace records
    its key and intent. A write the adapter may have received (running, pending) is never
    abandoned in an unknown state: the caller raises the adapter's fence to its own lease
    (so no older owner can land it any more), looks the key up and passes the answer as
    ``settled``. No receipt and none committed: the write never happened and now never
    can; it is dropped. A receipt of exactly this write (the one committed, if any): the
    write happened; it is recorded as executed before the run ends. ``by`` and
    ``request_id`` attribute the cancellation (an operator's signed request); ``observed``
    is the environment seen now, recorded when it differs from the run's.

    Raises:
        InvalidTransitionError: terminal or under review (a reviewer decides those), a
            pending write not looked up, or one the lookup cannot settle (no receipt for
            a committed one, another intent, a drifted receipt): the caller opens a review.
    """
    pending = state.pending
    info: dict[str, Any] = {"reason": reason[:1024]}
    if by:
        info["by"] = by[:200]
    if request_id:
        info["request_id"] = request_id[:200]
    executed = state.executed
    if pending is not None and state.phase is not Phase.AWAITING_APPROVAL:
        if settled is None:
            raise InvalidTransitionError("a pending write is in flight; reconcile it first")
        receipt, committed = settled.receipt, pending.receipt
        key = pending.action.idempotency_key or ""
        if receipt is None and committed is None:
            info |= {
                "dropped_key": key,
                "dropped_intent": pending.intent_digest,
                "looked_up": "absent",
            }
        elif (
            receipt is not None
            and receipt.idempotency_key == key
            and (receipt.intent_digest == pending.intent_digest)
            and (committed is None or committed.fingerprint == receipt.fingerprint)
        ):
            executed = (
                *executed,
                ExecutedWrite(
                    action_id=pending.action.action_id,
                    idempotency_key=key,
                    intent_digest=receipt.intent_digest,
                    receipt=receipt,
                    receipt_fingerprint=receipt.fingerprint,
                ),
            )
            info |= {"executed_key": key, "receipt_fingerprint": receipt.fingerprint}
        else:
            raise InvalidTransitionError(
                "the adapter's answer for the pending write's key "
                "does not settle it; it needs a review"
            )
    elif pending is not None:
        info |= {
            "dropped_key": pending.action.idempotency_key or "",
            "dropped_intent": pending.intent_digest,
        }
    phase = transition(state.phase, Event.CANCEL)
    stop = f"cancelled: {reason}"
    if observed is not None and not observed.same_state(state.environment):
        # Ended on an environment the run's checkpoint does not explain (edited behind it,
        # or a store rolled back past writes the adapter holds): said so, never hidden.
        info |= {
            "env_version_now": observed.version,
            "env_fingerprint_now": observed.fingerprint,
            "environment": "not the checkpoint's; not reconciled",
        }
        stop += " (the environment had changed behind the run; not reconciled)"
    event = _event(state, now, TraceOutcome.CANCELLED, detail=info)
    return _with(
        state, event, phase=phase, pending=None, executed=executed, stop_reason=stop[:4096]
    )


# --- rebaseline ------------------------------------------------------------------------------


def check_rebaseline(
    state: RunState,
    scenario: Scenario,
    decision: RebaselineDecision,
    reviewers: TrustRoots,
    *,
    generation: int,
) -> None:
    """The checks on a rebaseline decision that need no adapter: a running or waiting run,
    a trusted reviewer's valid signature, every binding (task, run, policy, the checkpoint
    generation, the environment the run recorded), an unused nonce, the same instance.

    Raises:
        ReviewDecisionError: ``reason`` names the failed check.
    """
    if state.phase not in (Phase.RUNNING, Phase.AWAITING_APPROVAL):
        raise ReviewDecisionError(f"a {state.phase.value} run is not rebaselined", reason="phase")
    reviewers.verify_rebaseline(decision)
    c, env = decision.claims, state.environment
    bound = {
        "task_id": (c.task_id, scenario.task_id),
        "run_id": (c.run_id, state.run_id),
        "policy": ((c.policy_id, c.policy_version), (scenario.policy_id, scenario.policy_version)),
        "generation": (c.generation, generation),
        "old_environment": (
            (c.old_env_instance_id, c.old_env_version, c.old_env_fingerprint),
            (env.instance_id, env.version, env.fingerprint),
        ),
    }
    for name, (claimed, actual) in bound.items():
        if claimed != actual:
            raise ReviewDecisionError(
                f"rebaseline is bound to another {name}", reason="binding", field=name
            )
    if c.new_env_instance_id != env.instance_id:
        raise ReviewDecisionError(
            "a rebaseline keeps the environment instance",
            reason="binding",
            field="new_env_instance_id",
        )
    if c.new_env_version < env.version:
        raise ReviewDecisionError(
            "a rebaseline never moves an environment back: it is behind the version the "
            "run recorded (restored from an older copy?), and what it recorded since is "
            "gone from it",
            reason="behind",
            field="new_env_version",
        )
    if c.nonce in state.consumed_nonces:
        raise ReviewDecisionError(
            "rebaseline nonce was already consumed", reason="replayed_nonce", nonce=c.nonce
        )


def decision_baseline(decision: RebaselineDecision) -> Observation:
    """The environment a rebaseline decision names as the new baseline."""
    c = decision.claims
    return Observation(
        instance_id=c.new_env_instance_id,
        version=c.new_env_version,
        fingerprint=c.new_env_fingerprint,
    )


def apply_rebaseline(
    state: RunState,
    scenario: Scenario,
    decision: RebaselineDecision,
    reviewers: TrustRoots,
    *,
    generation: int,
    observed: Observation,
    settled: Settled | None,
    now: int,
) -> RunState:
    """Make the environment as observed now the run's new baseline, on a reviewer's
    signed decision (all checks of :func:`check_rebaseline`, then: ``observed`` is exactly
    the environment the decision names).

    Every approval bound to the old state is void: a pending write is dropped (one only
    waiting for approval was never sent; one the adapter may have received must have been
    looked up, ``settled``, with no receipt: it never happened and, behind the raised
    fence, never can). The agent proposes again from the new baseline, and a write that
    needs approval needs a fresh one. The trace records the old and new environment.

    Raises:
        ReviewDecisionError: refused; nothing changed (``reason``: the check, or
            ``environment_changed``, ``pending_write_landed``).
    """
    check_rebaseline(state, scenario, decision, reviewers, generation=generation)
    if not observed.same_state(decision_baseline(decision)):
        raise ReviewDecisionError(
            "the environment changed after the rebaseline was signed", reason="environment_changed"
        )
    pending, c, old = state.pending, decision.claims, state.environment
    info: dict[str, Any] = {
        "reviewer_id": decision.reviewer_id,
        "incident_id": c.incident_id,
        "old_env_version": old.version,
        "old_env_fingerprint": old.fingerprint,
        "new_env_version": observed.version,
        "new_env_fingerprint": observed.fingerprint,
    }
    if pending is not None:
        if state.phase is not Phase.AWAITING_APPROVAL and (
            settled is None or settled.receipt is not None or pending.receipt is not None
        ):
            raise ReviewDecisionError(
                "the pending write may have reached the adapter; "
                "the change may be the run's own write",
                reason="pending_write_landed",
            )
        info |= {
            "dropped_key": pending.action.idempotency_key or "",
            "dropped_intent": pending.intent_digest,
        }
    event = _event(state, now, TraceOutcome.REBASELINED, detail=info)
    return _with(
        state,
        event,
        phase=transition(state.phase, Event.REBASELINE),
        pending=None,
        environment=observed,
        rebaselines=(*state.rebaselines, decision),
        consumed_nonces=(*state.consumed_nonces, c.nonce),
    )
