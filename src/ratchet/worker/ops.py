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
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from ratchet.errors import ConfigurationError, ContractError, IntegrityError
from ratchet.leasing import RunSnapshot
from ratchet.runtime import (
    ApprovalClaims,
    ApprovalEvidence,
    ReviewDecision,
    ReviewDecisionClaims,
    ReviewVerdict,
    RunEngine,
    RunState,
    sign_approval,
    sign_review_decision,
)
from ratchet.runtime.canonical import model_json
from ratchet.runtime.checkpoint import open_checkpoint
from ratchet.worker.context import Fleet
from ratchet.worker.job import SystemClock
from ratchet.worker.runs import RunDocument, build_adapter

__all__ = ["RunView", "approve", "inspect_run", "load_private_key", "review", "submit"]


def submit(fleet: Fleet, document: RunDocument, *, run_id: str | None = None) -> str:
    """Create and enqueue a run. Returns its id.

    Raises RunExistsError, ConfigurationError, AdapterError, CheckpointTooLargeError.
    """
    run_id = run_id or f"run-{secrets.token_hex(6)}"
    adapter = build_adapter(document)
    try:
        RunEngine.start(run_id, scenario=document.scenario, keyring=fleet.keyring,
                        adapter=adapter, store=fleet.store.creator(document.to_bytes()),
                        clock=SystemClock())
    finally:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()
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
    document = RunDocument.from_bytes(snap.scenario)
    payload = open_checkpoint(snap.checkpoint, keyring=fleet.keyring, archive=snap.archive)
    if payload.scenario_fingerprint != document.scenario.fingerprint:
        raise IntegrityError("the checkpoint was made under another scenario", run_id=run_id)
    if payload.generation != snap.generation:
        raise IntegrityError("the checkpoint is not at the high-water mark", run_id=run_id,
                             generation=payload.generation, high_water=snap.generation)
    return RunView(snap, document, payload.state, payload.generation,
                   fleet.store.incidents(run_id))


def approve(fleet: Fleet, run_id: str, action_id: str, *, key: Ed25519PrivateKey,
            approver_id: str, ttl_s: int = 3600, extra_proposals: int = 10) -> ApprovalEvidence:
    """Sign an approval of the run's pending write ``action_id`` and re-enqueue the run.

    Raises ContractError (nothing pending, another action), and what inspect_run raises.
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
        nonce=f"ap-{secrets.token_hex(12)}", expires_at=int(time.time()) + ttl_s,
        max_proposals=state.usage.proposals + extra_proposals)
    evidence = sign_approval(key, approver_id, claims)
    fleet.store.post_evidence(run_id, model_json(evidence))
    fleet.enqueue(run_id)
    return evidence


def review(fleet: Fleet, run_id: str, verdict: str, *, key: Ed25519PrivateKey,
           reviewer_id: str) -> ReviewDecision:
    """Sign a reviewer decision on the run's open case and re-enqueue the run.

    Raises ContractError (no open case, bad verdict), and what inspect_run raises.
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
    decision = sign_review_decision(key, reviewer_id, claims)
    fleet.store.post_evidence(run_id, model_json(decision))
    fleet.enqueue(run_id)
    return decision


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
