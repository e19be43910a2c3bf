"""Operator and submitter operations: submit, inspect, approve, review.

* :func:`submit` observes the run's environment, builds generation 1 with the engine and
  creates the run (document + signed checkpoint) in one script call, then enqueues it.
* :func:`inspect_run` reads a run and verifies its checkpoint (HMAC with the fleet's key
  ring, generation equal to the high-water mark) before anything of it is shown, so an
  operator never signs what a tampered store displays.
* :func:`approve` and :func:`review` sign exactly what :func:`inspect_run` shows (the
  pending write, or the open review case, at the current generation), leave the evidence
  in the run's inbox and re-enqueue the run. Private keys stay with the signer; workers
  verify with public keys only.
* :func:`post_approval` and :func:`post_review_decision` check signed evidence before it
  is posted, with the checks the worker makes (trust root, signature, signer, every
  binding, the nonce in the run and in the store, expiry by the store's clock), so a bad
  piece is refused at once with a typed error instead of later in a worker. The worker's
  own checks stay as strict. Without a trust root here (no ``RATCHET_APPROVERS_FILE`` /
  ``RATCHET_REVIEWERS_FILE``) the evidence is posted signed but unverified, and the
  result says so.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from ratchet.errors import (
    ApprovalError,
    ConfigurationError,
    ContractError,
    EvidenceError,
    IntegrityError,
    ReviewDecisionError,
)
from ratchet.leasing import RunSnapshot
from ratchet.leasing.keys import check_id
from ratchet.runtime import (
    ApprovalClaims,
    ApprovalEvidence,
    ReviewDecision,
    ReviewDecisionClaims,
    ReviewVerdict,
    RunEngine,
    RunState,
    machine,
    sign_approval,
    sign_review_decision,
)
from ratchet.runtime.canonical import model_json
from ratchet.runtime.checkpoint import open_checkpoint
from ratchet.runtime.state import TERMINAL_PHASES
from ratchet.worker.clock import StoreClock
from ratchet.worker.context import Fleet
from ratchet.worker.runs import (
    RunDocument,
    build_adapter,
    check_document_binding,
    document_digest,
    open_document,
    seal_document,
)

__all__ = [
    "Posted",
    "RunView",
    "approve",
    "create_run",
    "inspect_run",
    "load_private_key",
    "post_approval",
    "post_review_decision",
    "retry",
    "review",
    "submit",
]


def create_run(fleet: Fleet, document: RunDocument, *, run_id: str | None = None) -> str:
    """Create a run without enqueueing it: the signed document and generation 1 (which
    binds the document's digest) in one script call. Returns its id.

    The agent is resolved and built first, under the same rule a worker applies
    (:class:`ratchet.worker.agents.AgentPolicy`), so a run whose agent no worker here
    could load is refused now rather than crash-looping later.

    Raises RunExistsError, ConfigurationError (agent not allowed or unloadable, bad
    environment), AdapterError, CheckpointTooLargeError.
    """
    run_id = check_id(run_id or f"run-{secrets.token_hex(6)}", "run_id")
    fleet.check_eviction_policy()
    fleet.agent_policy.build(document.agent, dict(document.agent_config))
    sent_at = time.monotonic()
    clock = StoreClock(fleet.store.server_time_ms(), sent_at=sent_at)  # the run's start
    adapter = build_adapter(document)
    try:
        RunEngine.start(run_id, scenario=document.scenario, keyring=fleet.keyring,
                        adapter=adapter,
                        store=fleet.store.creator(seal_document(fleet.keyring, run_id,
                                                                document)),
                        clock=clock, document_digest=document_digest(document))
    finally:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()
    return run_id


def submit(fleet: Fleet, document: RunDocument, *, run_id: str | None = None) -> str:
    """Create (:func:`create_run`) and enqueue a run. Returns its id.

    Raises what :func:`create_run` raises.
    """
    run_id = create_run(fleet, document, run_id=run_id)
    fleet.enqueue(run_id)
    return run_id


@dataclass(frozen=True, slots=True)
class RunView:
    """A run as an operator sees it: verified state plus what Redis says about it."""

    snapshot: RunSnapshot
    document: RunDocument
    state: RunState
    generation: int
    incidents: list[dict[str, Any]]


def inspect_run(fleet: Fleet, run_id: str) -> RunView:
    """Read and verify a run. Raises RunNotFoundError, CheckpointError, IntegrityError."""
    snap = fleet.store.read_run(run_id, with_checkpoint=True, with_scenario=True)
    if snap.checkpoint is None or snap.scenario is None:
        raise IntegrityError("the run has no checkpoint or document", run_id=run_id)
    document = open_document(fleet.keyring, run_id, snap.scenario)
    payload = open_checkpoint(snap.checkpoint, keyring=fleet.keyring, archive=snap.archive)
    check_document_binding(payload.state, document)
    if payload.scenario_fingerprint != document.scenario.fingerprint:
        raise IntegrityError("the checkpoint was made under another scenario", run_id=run_id)
    if payload.generation != snap.generation:
        raise IntegrityError("the checkpoint is not at the high-water mark", run_id=run_id,
                             generation=payload.generation, high_water=snap.generation)
    return RunView(snap, document, payload.state, payload.generation,
                   fleet.store.incidents(run_id))


@dataclass(frozen=True, slots=True)
class Posted:
    """Evidence left in a run's inbox. ``verified`` is False when no trust root was
    available here to check it (it was signed, not verified; the worker still checks)."""

    evidence: ApprovalEvidence | ReviewDecision
    verified: bool


def _post(fleet: Fleet, run_id: str, evidence: ApprovalEvidence | ReviewDecision,
          verified: bool, error: type[EvidenceError]) -> Posted:
    """Refuse a nonce another run consumed (the store's global record), then leave the
    evidence in the run's inbox and re-enqueue the run."""
    nonce = evidence.claims.nonce
    holder = fleet.store.nonce_claimed_by(nonce)
    if holder is not None and holder != run_id:
        raise error("the nonce was already consumed by another run",
                    reason="replayed_nonce", nonce=nonce)
    fleet.store.post_evidence(run_id, model_json(evidence))
    fleet.enqueue(run_id)
    return Posted(evidence, verified)


def post_approval(fleet: Fleet, run_id: str, evidence: ApprovalEvidence) -> Posted:
    """Check ``evidence`` as the worker will, then leave it in the run's inbox and
    re-enqueue the run.

    Raises:
        ApprovalError: unknown or revoked approver, bad signature, bound to another run,
            task, policy, action, key, intent, environment or generation, a nonce already
            consumed (by this run or another), expired by the store's clock. Nothing is
            posted.
        ContractError, and what :func:`inspect_run` raises.
    """
    view = inspect_run(fleet, run_id)
    verified = fleet.approvers is not None
    if fleet.approvers is not None:
        now = fleet.store.server_time_ms() // 1000
        machine.attach_approval(view.state, view.document.scenario, evidence,
                                fleet.approvers, generation=view.generation, now=now)
    return _post(fleet, run_id, evidence, verified, ApprovalError)


def post_review_decision(fleet: Fleet, run_id: str, decision: ReviewDecision) -> Posted:
    """Check ``decision`` as far as it can be without the adapter (the worker re-reads
    the receipt and the environment when it consumes it), then post and re-enqueue.

    Raises:
        ReviewDecisionError: no open case, unknown or revoked reviewer, bad signature,
            any binding, a nonce already consumed. Nothing is posted.
        ContractError, and what :func:`inspect_run` raises.
    """
    view = inspect_run(fleet, run_id)
    verified = fleet.reviewers is not None
    if fleet.reviewers is not None:
        machine.check_review_decision(view.state, view.document.scenario, decision,
                                      fleet.reviewers)
    elif view.state.review is None:
        raise ReviewDecisionError("no review case is open", reason="no_open_case")
    return _post(fleet, run_id, decision, verified, ReviewDecisionError)


def approve(fleet: Fleet, run_id: str, action_id: str, *, key: Ed25519PrivateKey,
            approver_id: str, ttl_s: int = 3600, extra_proposals: int = 10) -> Posted:
    """Sign an approval of the run's pending write ``action_id``, check it as the worker
    will (:func:`post_approval`), post it and re-enqueue the run.

    The expiry counts from the store's clock, the clock the checks use.

    Raises ContractError (nothing pending, another action), ApprovalError (see
    :func:`post_approval`), and what inspect_run raises.
    """
    view = inspect_run(fleet, run_id)
    state, pending = view.state, view.state.pending
    if pending is None:
        raise ContractError("the run has no pending write to approve", run_id=run_id)
    if pending.action.action_id != action_id:
        raise ContractError("the pending write is another action", run_id=run_id,
                            pending_action_id=pending.action.action_id)
    env = state.environment
    claims = ApprovalClaims(
        task_id=state.task_id, run_id=run_id, policy_id=state.policy_id,
        policy_version=state.policy_version, action_id=action_id,
        idempotency_key=pending.action.idempotency_key or "",
        intent_digest=pending.intent_digest, env_instance_id=env.instance_id,
        env_fingerprint=env.fingerprint, env_version=env.version, generation=view.generation,
        nonce=f"ap-{secrets.token_hex(12)}",
        expires_at=fleet.store.server_time_ms() // 1000 + ttl_s,
        max_proposals=state.usage.proposals + extra_proposals)
    return post_approval(fleet, run_id, sign_approval(key, approver_id, claims))


def review(fleet: Fleet, run_id: str, verdict: str, *, key: Ed25519PrivateKey,
           reviewer_id: str) -> Posted:
    """Sign a reviewer decision on the run's open case, check it
    (:func:`post_review_decision`), post it and re-enqueue the run.

    Raises ContractError (no open case, bad verdict), ReviewDecisionError, and what
    inspect_run raises.
    """
    view = inspect_run(fleet, run_id)
    case = view.state.review
    if case is None:
        raise ContractError("the run has no open review case", run_id=run_id)
    try:
        decided = ReviewVerdict(verdict)
    except ValueError:
        raise ContractError("decision must be replan or abort", field="decision") from None
    state = view.state
    claims = ReviewDecisionClaims(
        task_id=state.task_id, run_id=run_id, policy_id=state.policy_id,
        policy_version=state.policy_version, case_id=case.case_id,
        action_id=case.pending.action.action_id,
        idempotency_key=case.pending.action.idempotency_key or "",
        pending_intent_digest=case.pending.intent_digest,
        receipt_intent_digest=case.receipt.intent_digest if case.receipt else None,
        receipt_fingerprint=case.receipt_fingerprint,
        env_instance_id=case.environment.instance_id, env_version=case.environment.version,
        verdict=decided, nonce=f"rv-{secrets.token_hex(12)}")
    return post_review_decision(fleet, run_id, sign_review_decision(key, reviewer_id, claims))


def retry(fleet: Fleet, run_id: str, *, reason: str, operator: str) -> None:
    """Hand a run frozen by an incident whose cause was outside it (an agent that could not
    be loaded, an adapter that was down, a poisoned job) to the workers again, once the
    operator fixed the cause. Records who, why and when (an ``operator_retry`` incident,
    which also restarts the run's job-error budget), then re-enqueues it. It bypasses
    nothing: the worker restores the run with every check, as for any job.

    Raises ContractError (a terminal run, a run a live worker holds, an empty reason), and
    what :func:`inspect_run` raises (a run that does not verify is not retried).
    """
    if not reason.strip():
        raise ContractError("say why the run is retried", field="reason")
    view = inspect_run(fleet, run_id)
    phase = view.state.phase
    if phase in TERMINAL_PHASES:
        raise ContractError(f"the run is {phase.value}; nothing to retry", run_id=run_id)
    if view.snapshot.lease_live:
        raise ContractError(f"a worker holds the run ({view.snapshot.owner}); nothing to retry",
                            run_id=run_id)
    fleet.store.record_incident(run_id, {"kind": "operator_retry", "operator": operator[:100],
                                         "reason": reason[:500], "phase": phase.value})
    fleet.enqueue(run_id)


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM. Raises ConfigurationError."""
    try:
        key = load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise ConfigurationError("the key file is not an unencrypted PEM private key") \
            from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigurationError("the key file is not an Ed25519 private key")
    return key
