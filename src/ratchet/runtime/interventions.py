"""The human controls of a running engine: a fresh approval for the pending write, a
reviewer's decision, a cancel, a rebaseline.

Each function here is what one of :class:`~ratchet.runtime.engine.RunEngine`'s public
methods does (the method delegates, keeping its signature and its documentation). They
look up and observe what a person's decision needs, apply the pure transition
(:mod:`ratchet.runtime.decisions`, :func:`~ratchet.runtime.machine.attach_approval`) and
commit it through the engine's own commit, so the order of commits and adapter calls is
still decided by the engine, and ``engine.py`` keeps the durable step (propose,
reconcile, commit, flush). Every effect is yielded to the engine's executor: nothing here
performs one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ratchet.errors import ConfigurationError, InvalidTransitionError, OutcomeUnknownError
from ratchet.runtime import decisions, machine, outcomes
from ratchet.runtime.effects import Observe, Op, RaiseFence
from ratchet.runtime.evidence import ApprovalEvidence, RebaselineDecision, ReviewDecision
from ratchet.runtime.ports import Observation
from ratchet.runtime.state import Phase, ReviewReason

if TYPE_CHECKING:
    from ratchet.runtime.engine import RunEngine, StepResult

__all__ = [
    "apply_rebaseline",
    "apply_review_decision",
    "cancel",
    "refresh_pending_approval",
]


def refresh_pending_approval(
    engine: RunEngine, evidence: ApprovalEvidence, *, execute: bool
) -> StepResult:
    """:meth:`RunEngine.refresh_pending_approval`: the approval is checked before any
    effect, then committed and (``execute``) the pending write sent."""
    if engine.approvers is None:
        raise ConfigurationError("no approver trust root configured")
    new = machine.attach_approval(
        engine.state,
        engine.scenario,
        evidence,
        engine.approvers,
        generation=engine.generation,
        now=engine.clock.now(),
    )

    def refresh() -> Op[None]:
        yield from engine._commit(new)
        if execute:
            yield from engine._execute_pending()

    engine._drive(refresh())
    return engine._result()


def apply_review_decision(engine: RunEngine, decision: ReviewDecision) -> StepResult:
    """:meth:`RunEngine.apply_review_decision`: the authoritative receipt is read again
    and the environment observed, so the decision is judged against the world now."""
    if engine.reviewers is None:
        raise ConfigurationError("no reviewer trust root configured")
    reviewers = engine.reviewers

    def decide() -> Op[None]:
        case = engine.state.review
        authoritative = None
        if case is not None and case.pending.action.idempotency_key:
            try:
                authoritative = yield from engine._lookup(case.pending.action)
            except OutcomeUnknownError:
                authoritative = None  # the reviewer decides what happened
        observed = cast(Observation, (yield Observe()))
        new = decisions.apply_review_decision(
            engine.state,
            engine.scenario,
            decision,
            reviewers,
            authoritative=authoritative,
            observed=observed,
            now=engine.clock.now(),
        )
        yield from engine._commit(new)

    engine._drive(decide())
    return engine._result()


def _settle_pending(engine: RunEngine) -> Op[decisions.Settled | None]:
    """Look the pending write's key up at the adapter, behind this lease's fence, for
    a control that ends or rebases the run (None: nothing is pending, or only a write
    waiting for approval, which was never sent).

    Timeline: fence raised (resume did; again here for a caller that did not) -> key
    looked up. From the fence on, no older owner can land the write, so "no receipt"
    means it never happened and never will.
    """
    pending = engine.state.pending
    if pending is None or engine.state.phase is not Phase.RUNNING:
        return None
    yield RaiseFence(engine._fence())
    receipt = yield from engine._lookup(pending.action)
    return decisions.Settled(receipt)


def cancel(engine: RunEngine, reason: str, by: str, request_id: str) -> Op[StepResult]:
    """:meth:`RunEngine.cancel`'s operation: settle the pending write by its key, then
    commit the cancel, or the review case an unsettled write needs instead."""
    try:
        settled = yield from _settle_pending(engine)
    except OutcomeUnknownError as exc:
        # The write may have happened: a cancel cannot drop it; a reviewer decides.
        yield from engine._outcome_unknown(exc)
        return engine._result()
    observed = (
        engine.observed_at_restore if settled is None else (cast(Observation, (yield Observe())))
    )
    now = engine.clock.now()
    try:
        new = decisions.cancel(
            engine.state,
            reason,
            now=now,
            by=by,
            request_id=request_id,
            settled=settled,
            observed=observed,
        )
    except InvalidTransitionError:
        pending = engine.state.pending
        if settled is None or pending is None:
            raise
        receipt = settled.receipt
        reason_code = (
            ReviewReason.RECEIPT_MISSING
            if receipt is None
            else ReviewReason.INTENT_CONFLICT
            if receipt.intent_digest != pending.intent_digest
            else ReviewReason.RECEIPT_DRIFT
        )
        new = outcomes.open_review(
            engine.state,
            reason_code,
            receipt,
            now=now,
            observed=observed,
            detail="found while settling a cancelled run's write",
        )
    yield from engine._commit(new)
    return engine._result()


def apply_rebaseline(engine: RunEngine, decision: RebaselineDecision) -> StepResult:
    """:meth:`RunEngine.apply_rebaseline`: the checks that need no adapter run first, so
    a refused decision costs no lookup; then the pending write is settled and the
    environment observed."""
    if engine.reviewers is None:
        raise ConfigurationError("no reviewer trust root configured")
    reviewers = engine.reviewers
    decisions.check_rebaseline(
        engine.state, engine.scenario, decision, reviewers, generation=engine.generation
    )

    def rebase() -> Op[None]:
        settled = yield from _settle_pending(engine)
        observed = cast(Observation, (yield Observe()))
        new = decisions.apply_rebaseline(
            engine.state,
            engine.scenario,
            decision,
            reviewers,
            generation=engine.generation,
            observed=observed,
            settled=settled,
            now=engine.clock.now(),
        )
        yield from engine._commit(new)

    engine._drive(rebase())
    return engine._result()
