"""The run state: phases, the transition table, the trace, and cross-object invariants.

Phase changes are plain data (:data:`TRANSITIONS`); :func:`transition` is the only function
that moves a phase. Events that leave the phase unchanged (a read, a rejected proposal) are
not phase events and never go through the table.

::

    running ──pending needs approval / approval expired──▶ awaiting_approval
    awaiting_approval ──fresh exact approval──▶ running
    running | awaiting_approval ──receipt conflict / drift / missing──▶ needs_review
    needs_review ──signed replan──▶ running        needs_review ──signed abort──▶ failed
    running ──verified finish──▶ completed
    running | awaiting_approval ──cancel──▶ cancelled
    running | awaiting_approval ──signed rebaseline──▶ running
    running | awaiting_approval ──budget exhausted / fatal error──▶ failed
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal, cast

from pydantic import Field, Strict

from ratchet.errors import InvalidTransitionError, InvariantViolation
from ratchet.runtime.actions import Action
from ratchet.runtime.evidence import ApprovalEvidence, RebaselineDecision, ReviewDecision
from ratchet.runtime.history import extends, key_positions, position
from ratchet.runtime.ports import Observation, Receipt, VerifierReport
from ratchet.runtime.scenario import Scenario
from ratchet.runtime.types import Digest, Frozen, Identifier, JsonObject, NonNegInt, PosInt
from ratchet.runtime.window import KeySet, NotInWindow

__all__ = [
    "STATE_SCHEMA_VERSION",
    "TERMINAL_PHASES",
    "TRANSITIONS",
    "Event",
    "ExecutedKeys",
    "ExecutedWrite",
    "PendingWrite",
    "Phase",
    "ReviewCase",
    "ReviewReason",
    "RunState",
    "TraceEvent",
    "TraceOutcome",
    "Usage",
    "check_invariants",
    "transition",
]

STATE_SCHEMA_VERSION: Literal[1] = 1


class Phase(StrEnum):
    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting_approval"
    NEEDS_REVIEW = "needs_review"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


TERMINAL_PHASES = frozenset({Phase.COMPLETED, Phase.CANCELLED, Phase.FAILED})


class Event(StrEnum):
    APPROVAL_NEEDED = "approval_needed"
    APPROVAL_GRANTED = "approval_granted"
    REVIEW_OPENED = "review_opened"
    REVIEW_REPLAN = "review_replan"
    REVIEW_ABORT = "review_abort"
    COMPLETE = "complete"
    CANCEL = "cancel"
    REBASELINE = "rebaseline"
    BUDGET_EXHAUSTED = "budget_exhausted"
    FATAL_ERROR = "fatal_error"


TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.RUNNING, Event.APPROVAL_NEEDED): Phase.AWAITING_APPROVAL,
    (Phase.AWAITING_APPROVAL, Event.APPROVAL_GRANTED): Phase.RUNNING,
    (Phase.RUNNING, Event.REVIEW_OPENED): Phase.NEEDS_REVIEW,
    (Phase.AWAITING_APPROVAL, Event.REVIEW_OPENED): Phase.NEEDS_REVIEW,
    (Phase.NEEDS_REVIEW, Event.REVIEW_REPLAN): Phase.RUNNING,
    (Phase.NEEDS_REVIEW, Event.REVIEW_ABORT): Phase.FAILED,
    (Phase.RUNNING, Event.COMPLETE): Phase.COMPLETED,
    (Phase.RUNNING, Event.CANCEL): Phase.CANCELLED,
    (Phase.AWAITING_APPROVAL, Event.CANCEL): Phase.CANCELLED,
    (Phase.RUNNING, Event.REBASELINE): Phase.RUNNING,
    (Phase.AWAITING_APPROVAL, Event.REBASELINE): Phase.RUNNING,
    (Phase.RUNNING, Event.BUDGET_EXHAUSTED): Phase.FAILED,
    (Phase.AWAITING_APPROVAL, Event.BUDGET_EXHAUSTED): Phase.FAILED,
    (Phase.RUNNING, Event.FATAL_ERROR): Phase.FAILED,
    (Phase.AWAITING_APPROVAL, Event.FATAL_ERROR): Phase.FAILED,
}


def transition(phase: Phase, event: Event) -> Phase:
    """The phase after ``event``. Raises InvalidTransitionError if the table has no row."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise InvalidTransitionError(
            f"event {event.value} is not allowed in phase {phase.value}",
            phase=phase.value,
            event=event.value,
        ) from None


class TraceOutcome(StrEnum):
    STARTED = "started"
    # Rejections: the proposal spent budget but changed nothing else.
    REJECTED_SCHEMA = "rejected_schema"
    REJECTED_PHASE = "rejected_phase"
    REJECTED_PENDING = "rejected_pending"
    REJECTED_PERMISSION = "rejected_permission"
    REJECTED_SCOPE = "rejected_scope"
    REJECTED_STALE_ENV = "rejected_stale_env"
    REJECTED_DEADLINE = "rejected_deadline"
    REJECTED_KEY_QUARANTINED = "rejected_key_quarantined"
    REJECTED_KEY_CONFLICT = "rejected_key_conflict"
    REJECTED_UNVERIFIED = "rejected_unverified"
    REJECTED_APPROVAL = "rejected_approval"
    # Progress.
    ACCEPTED_PENDING = "accepted_pending"
    AWAITING_APPROVAL = "awaiting_approval"
    APPROVAL_REFRESHED = "approval_refreshed"
    APPROVAL_EXPIRED = "approval_expired"
    RECEIPT_RECORDED = "receipt_recorded"
    EXECUTED = "executed"
    REPLAYED = "replayed"
    RECONCILED = "reconciled"
    READ = "read"
    VERIFIED = "verified"
    # Uncertainty and its resolution.
    REVIEW_OPENED = "review_opened"
    REVIEW_REPLANNED = "review_replanned"
    REVIEW_ABORTED = "review_aborted"
    REBASELINED = "rebaselined"
    EXECUTION_ERROR = "execution_error"
    # Ends.
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    BUDGET_EXHAUSTED = "budget_exhausted"
    FAILED = "failed"


_DetailValue = Annotated[str, Strict(), Field(max_length=4096)] | Annotated[int, Strict()]


class TraceEvent(Frozen):
    seq: PosInt
    at: NonNegInt
    outcome: TraceOutcome
    action_id: Identifier | None = None
    idempotency_key: Identifier | None = None
    intent_digest: Digest | None = None
    env_version: NonNegInt | None = None
    detail: dict[Annotated[str, Strict()], _DetailValue] = Field(default_factory=dict)
    sealed_approval: ApprovalEvidence | None = None
    verifier: VerifierReport | None = None


class PendingWrite(Frozen):
    """The single write a run has committed to before calling the adapter.

    ``env_before`` is the state the write was planned against; ``env_after`` the one-commit
    state the adapter projected (None if it cannot predict); ``receipt`` is set once the
    adapter's receipt is committed and before the state advances (crash window 4).
    """

    action: Action
    intent_digest: Digest
    env_before: Observation
    env_after: Observation | None
    approval: ApprovalEvidence | None = None
    receipt: Receipt | None = None
    replay_of: Digest | None = None


class ExecutedWrite(Frozen):
    """The runtime's cached copy of an executed write's receipt: rebuildable, not evidence."""

    action_id: Identifier
    idempotency_key: Identifier
    intent_digest: Digest
    receipt: Receipt
    receipt_fingerprint: Digest


class ReviewReason(StrEnum):
    INTENT_CONFLICT = "intent_conflict"
    RECEIPT_MISSING = "receipt_missing"
    RECEIPT_DRIFT = "receipt_drift"
    APPROVAL_UNBOUND = "approval_unbound"
    FENCE_REGRESSION = "fence_regression"
    # A write was sent to a tool that can neither look its key up nor be called again
    # safely, and the call was cut off: whether it happened is for a person to find out.
    OUTCOME_UNKNOWN = "outcome_unknown"


class ReviewCase(Frozen):
    """An open (or, once decided, sealed) question only a trusted reviewer can answer."""

    case_id: Identifier
    reason: ReviewReason
    pending: PendingWrite
    receipt: Receipt | None
    receipt_fingerprint: Digest | None
    environment: Observation
    opened_seq: PosInt
    decision: ReviewDecision | None = None


class Usage(Frozen):
    proposals: NonNegInt = 0
    steps: NonNegInt = 0
    cost_units: NonNegInt = 0


_KEY_SET = "_key_set"  # where a state keeps its key set, beside its fields


class RunState(Frozen):
    schema_version: Literal[1]
    run_id: Identifier
    task_id: Identifier
    task_version: Identifier
    policy_id: Identifier
    policy_version: Identifier
    scenario_fingerprint: Digest
    # The digest of the signed run document (scenario, agent, its config, environment,
    # verifier commands) this run was created from; None for a run made without one. It
    # never changes, and a worker uses a document only if its digest is this one.
    document_digest: Digest | None = None
    phase: Phase
    stop_reason: Annotated[str, Strict(), Field(max_length=4096)] | None = None
    plan_cursor: NonNegInt = 0
    # The agent's own JSON state, signed and committed with each proposal and handed back
    # on resume. Evidence of intent only: receipts and observations say what happened.
    agent_state: JsonObject = Field(default_factory=dict)
    usage: Usage
    started_at: NonNegInt
    environment: Observation
    last_write_env_version: NonNegInt | None = None
    pending: PendingWrite | None = None
    # The window of executed writes: ``executed_base`` older ones live in the run's archive
    # only (``ratchet.runtime.window``); 0 for a state that holds its whole history.
    executed_base: NonNegInt = 0
    executed: tuple[ExecutedWrite, ...] = ()
    quarantined_keys: tuple[Identifier, ...] = ()
    consumed_nonces: tuple[Identifier, ...] = ()
    review: ReviewCase | None = None
    closed_reviews: tuple[ReviewCase, ...] = ()
    # Reviewers' signed decisions that made a changed environment the run's new baseline
    # (oldest first); each one's nonce is consumed.
    rebaselines: tuple[RebaselineDecision, ...] = ()
    verification: VerifierReport | None = None
    # The window of trace events: ``trace_base`` older ones live in the archive only.
    trace_base: NonNegInt = 0
    trace: tuple[TraceEvent, ...] = ()

    def cached(self, key: str) -> ExecutedWrite | None:
        """The executed write of ``key``, or None when the run never executed it.

        Raises:
            NotInWindow: it was executed before the window and is not recalled yet.
            InvariantViolation: the state is windowed but carries no key set.
        """
        # An index kept along the window: a proposal's cost must not grow with the run.
        found = position(self.executed, key)
        if found is not None:
            return self.executed[found]
        ordinal = self._older(key)
        if ordinal is None:
            return None
        keys = cast(KeySet, self.keys)
        entry = keys.recalled(key)
        if entry is None:
            raise NotInWindow(key, ordinal)
        return entry

    def has_executed(self, key: str) -> bool:
        """Whether the run executed a write with ``key`` (in the window or before it)."""
        return position(self.executed, key) is not None or self._older(key) is not None

    def _older(self, key: str) -> int | None:
        if not self.executed_base:
            return None
        keys = self.keys
        if keys is None:
            raise _fail("a windowed state carries no executed-key set", field="executed_base")
        return keys.older(key, self.executed_base)

    def with_keys(self, keys: KeySet | None) -> RunState:
        """A copy of this state carrying ``keys``: the digests of every executed write's key
        (set on a windowed state by restore and by the engine). Kept beside the fields, as
        a cached property is: copies carry it, and it is not part of the state's value
        (equality, dumps and the signature see the fields only)."""
        copy = self.model_copy()
        copy.__dict__[_KEY_SET] = keys
        return copy

    @property
    def keys(self) -> KeySet | None:
        found: KeySet | None = self.__dict__.get(_KEY_SET)
        return found

    @property
    def next_seq(self) -> int:
        return self.trace_base + len(self.trace) + 1


class ExecutedKeys:
    """The idempotency keys a run executed, as a membership test (``key in keys``) that
    costs the same at any run length, older writes included; ``len()`` counts them."""

    __slots__ = ("_state",)

    def __init__(self, state: RunState) -> None:
        self._state = state

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._state.has_executed(key)

    def __len__(self) -> int:
        return self._state.executed_base + len(self._state.executed)

    def __repr__(self) -> str:
        return f"ExecutedKeys(count={len(self)})"


def _fail(message: str, **context: Any) -> InvariantViolation:
    return InvariantViolation(f"invalid run state: {message}", **context)


def check_invariants(
    state: RunState, scenario: Scenario, *, previous: RunState | None = None
) -> None:
    """Check every cross-object invariant of ``state`` under ``scenario``.

    Explicit checks, never ``assert``: they must hold under ``python -O`` too. With
    ``previous`` (the state last committed, already checked), trace events and executed
    entries that are the same as in ``previous`` (the very same objects, or equal frozen
    ones) are not checked again, so the cost follows what changed, not the run's length.

    Raises:
        InvariantViolation: naming the broken invariant.
    """
    if state.scenario_fingerprint != scenario.fingerprint:
        raise _fail("scenario fingerprint differs", field="scenario_fingerprint")
    if (state.task_id, state.task_version, state.policy_id, state.policy_version) != (
        scenario.task_id,
        scenario.task_version,
        scenario.policy_id,
        scenario.policy_version,
    ):
        raise _fail("task or policy differs from the scenario", field="task_id")
    if previous is not None and state.document_digest != previous.document_digest:
        raise _fail("the run document's digest changed", field="document_digest")
    trace, checked, base = state.trace, 0, state.trace_base
    if previous is not None and previous.trace_base == base and extends(trace, previous.trace):
        checked = len(previous.trace)
    for index in range(checked, len(trace)):
        if trace[index].seq != base + index + 1:
            raise _fail(
                "trace sequence numbers are not contiguous", field="trace", seq=base + index + 1
            )
    budgets = scenario.budgets
    if state.usage.proposals > budgets.proposals or state.usage.steps > budgets.steps:
        raise _fail("usage exceeds the proposal or step budget", field="usage")
    if state.usage.cost_units > budgets.cost_units:
        raise _fail("usage exceeds the cost budget", field="usage")
    if state.usage.steps > state.usage.proposals:
        raise _fail("more steps than proposals", field="usage")
    executed, known = state.executed, 0
    if (
        previous is not None
        and previous.executed_base == state.executed_base
        and extends(executed, previous.executed)
    ):
        known = len(previous.executed)  # checked then: unique keys, receipts that match
    if known < len(executed):
        # A key is unique when its first position is its own and it is not older.
        positions = key_positions(executed)
        for offset in range(known, len(executed)):
            key = executed[offset].idempotency_key
            if positions.get(key) != offset or state._older(key) is not None:
                raise _fail("an idempotency key was executed twice", field="executed")
    for entry in executed[known:]:
        if entry.receipt.idempotency_key != entry.idempotency_key:
            raise _fail("cached receipt names another key", field="executed")
        if entry.receipt.intent_digest != entry.intent_digest:
            raise _fail("cached receipt has another intent", field="executed")
        if entry.receipt.fingerprint != entry.receipt_fingerprint:
            raise _fail("cached receipt fingerprint is stale", field="executed")
    if len(set(state.consumed_nonces)) != len(state.consumed_nonces):
        raise _fail("a nonce is recorded twice", field="consumed_nonces")
    if len(set(state.quarantined_keys)) != len(state.quarantined_keys):
        raise _fail("a key is quarantined twice", field="quarantined_keys")
    _check_pending(state)
    _check_phase(state)


def _check_pending(state: RunState) -> None:
    pending = state.pending
    if pending is None:
        return
    action = pending.action
    if not action.is_write:
        raise _fail("the pending action is not a write", field="pending")
    if pending.intent_digest != action.intent_digest:
        raise _fail("pending intent digest does not match its action", field="pending")
    if pending.env_before.instance_id != state.environment.instance_id:
        raise _fail("pending write planned on another environment instance", field="pending")
    key = action.idempotency_key
    if key in state.quarantined_keys and state.phase is not Phase.NEEDS_REVIEW:
        raise _fail("pending write uses a quarantined key", field="pending")
    if pending.approval is not None:
        c = pending.approval.claims
        if (c.action_id, c.idempotency_key, c.intent_digest) != (
            action.action_id,
            key,
            pending.intent_digest,
        ):
            raise _fail("pending approval is bound to another action", field="pending")
        if c.nonce not in state.consumed_nonces:
            raise _fail("pending approval nonce is not recorded as consumed", field="pending")
    if pending.receipt is not None:
        if pending.receipt.idempotency_key != key:
            raise _fail("pending receipt names another key", field="pending")
        if pending.receipt.intent_digest != pending.intent_digest:
            raise _fail("pending receipt has another intent", field="pending")


def _check_phase(state: RunState) -> None:
    phase = state.phase
    if (phase is Phase.NEEDS_REVIEW) != (state.review is not None):
        raise _fail("a review case is open exactly when the phase is needs_review", field="review")
    if state.review is not None and state.review.pending != state.pending:
        raise _fail("the review case does not hold the pending write", field="review")
    if phase is Phase.AWAITING_APPROVAL and state.pending is None:
        raise _fail("awaiting approval with nothing pending", field="phase")
    if phase in TERMINAL_PHASES and state.pending is not None:
        raise _fail("a terminal run still has a pending write", field="pending")
    for decision in state.rebaselines:
        if decision.claims.nonce not in state.consumed_nonces:
            raise _fail(
                "a rebaseline decision's nonce is not recorded as consumed", field="rebaselines"
            )
    for case in state.closed_reviews:
        if case.decision is None:
            raise _fail("a closed review case has no decision", field="closed_reviews")
    if phase is Phase.COMPLETED:
        report = state.verification
        if report is None or not report.passed:
            raise _fail("completed without a passing verifier report", field="verification")
        env = state.environment
        if (report.env_instance_id, report.env_version, report.env_fingerprint) != (
            env.instance_id,
            env.version,
            env.fingerprint,
        ) or (
            state.last_write_env_version is not None
            and report.env_version < state.last_write_env_version
        ):
            raise _fail(
                "completion evidence is not bound to the last write's version", field="verification"
            )
        # The report alone is a claim; the finish gate accepted it only because a passing
        # verifier event of that very report is in the trace. Restore (of a checkpoint
        # re-signed by anyone who holds the key) must find the same event.
        if not any(
            e.outcome is TraceOutcome.VERIFIED and e.verifier == report
            for e in reversed(state.trace)
        ):
            raise _fail("completed without a passing verifier event in the trace", field="trace")
