"""The run's inbox, as a job reads it: operator controls and signed evidence.

Before the agent is loaded, a verified cancel request or rebaseline decision is found
(:func:`find_job_controls`); after the reconcile, approvals and review decisions waiting
for the run are applied (:func:`consume_inbox`); while the job steps, a cancel request is
looked for about once per renewal interval (:class:`CancelWatch`). Entries that do not
verify are recorded as incidents and never acted on.
"""

from __future__ import annotations

import contextlib
import time

from ratchet.errors import ConfigurationError, EvidenceError, InvalidTransitionError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.fleet.control import CancelRequest, find_controls, find_rebaseline
from ratchet.fleet.runs import RunDocument, parse_evidence
from ratchet.runtime import (
    ApprovalEvidence,
    Phase,
    RebaselineDecision,
    ReviewDecision,
    RunEngine,
    RunState,
)
from ratchet.runtime.checkpoint import CheckpointPayload

__all__ = [
    "CancelWatch",
    "cancel_run",
    "consume_inbox",
    "decision_waiting",
    "find_job_controls",
]


def find_job_controls(
    fleet: Fleet, run_id: str, inbox: list[bytes], opened: CheckpointPayload, document: RunDocument
) -> tuple[CancelRequest | None, RebaselineDecision | None]:
    """The operator controls waiting in the inbox for the opened (not yet restored) run:
    a verified cancel request (not for a run under review: a reviewer decides it; the
    request stays and applies once the run leaves review), else a rebaseline decision
    that passed every check the adapter is not needed for. Entries that did not verify
    are recorded as incidents and never acted on."""
    controls = find_controls(fleet.keyring, run_id, inbox)
    refusals = [("control_refused", reason) for reason in controls.refused]
    cancel = controls.cancel if opened.state.phase is not Phase.NEEDS_REVIEW else None
    rebaseline = None
    if cancel is None:
        rebaseline, refused = find_rebaseline(
            inbox, opened.state, document.scenario, fleet.reviewers, generation=opened.generation
        )
        refusals += [("evidence_refused", reason) for reason in refused]
    for kind, reason in refusals:
        with contextlib.suppress(RatchetError):
            fleet.store.records.record_incident(run_id, {"kind": kind, "message": reason[:500]})
    return cancel, rebaseline


def decision_waiting(inbox: list[bytes], state: RunState) -> bool:
    """Whether the inbox holds a reviewer decision on the open case not yet consumed."""
    case = state.review
    for raw in inbox:
        evidence = parse_evidence(raw)
        if (
            isinstance(evidence, ReviewDecision)
            and case is not None
            and evidence.claims.case_id == case.case_id
            and evidence.claims.nonce not in state.consumed_nonces
        ):
            return True
    return False


def cancel_run(engine: RunEngine, request: CancelRequest | None) -> None:
    """Carry out an operator's verified cancel request (see ratchet.fleet.control); the
    finish reports it by the phase it leaves (cancelled, or waiting under review)."""
    if request is None:
        raise InvalidTransitionError("a cancel needs a request")
    engine.cancel(request.reason, by=request.by, request_id=request.request_id)


def consume_inbox(fleet: Fleet, engine: RunEngine, inbox: list[bytes]) -> None:
    """Apply signed evidence an operator left for a waiting run (approve / review).

    Each piece is verified by the engine (trust root, signature, bindings, nonce, expiry,
    fresh receipt and environment); refused evidence changes nothing and is recorded as
    an incident for the operator.
    """
    run_id = engine.state.run_id
    for raw in inbox:
        phase = engine.state.phase
        if phase not in (Phase.AWAITING_APPROVAL, Phase.NEEDS_REVIEW):
            return
        evidence = parse_evidence(raw)
        try:
            if isinstance(evidence, ApprovalEvidence) and phase is Phase.AWAITING_APPROVAL:
                if evidence.claims.nonce in engine.state.consumed_nonces:
                    continue
                engine.refresh_pending_approval(evidence)
            elif isinstance(evidence, ReviewDecision) and phase is Phase.NEEDS_REVIEW:
                if evidence.claims.nonce in engine.state.consumed_nonces:
                    continue
                engine.apply_review_decision(evidence)
        except (EvidenceError, ConfigurationError) as exc:
            fleet.store.records.record_incident(
                run_id,
                {
                    "kind": "evidence_refused",
                    "reason": str(getattr(exc, "reason", "")),
                    "message": exc.message,
                },
            )


class CancelWatch:
    """Re-reads the run's inbox for a cancel request at most once per renewal interval,
    so a run a worker is stepping stops within about one interval of the request, at a
    cost that does not grow with the step rate."""

    def __init__(self, fleet: Fleet, run_id: str) -> None:
        self._fleet = fleet
        self._run_id = run_id
        self._every = fleet.settings.renew_interval / 1000
        self._next = time.monotonic() + self._every

    def poll(self) -> CancelRequest | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self._every
        inbox = self._fleet.store.records.inbox(self._run_id)
        return find_controls(self._fleet.keyring, self._run_id, inbox).cancel
