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
* :func:`cancel` leaves a sealed cancel request for the workers and :func:`rebaseline` a
  reviewer's signed rebaseline decision (see :mod:`ratchet.fleet.control`); :func:`retry`
  hands a run frozen by an outside cause back.
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
from collections.abc import Callable
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
    RunNotFoundError,
)
from ratchet.fleet.clock import StoreClock
from ratchet.fleet.context import Fleet
from ratchet.fleet.control import CancelRequest, new_cancel_request, seal_cancel
from ratchet.fleet.runbuild import build_adapter, check_credentials, make_run_branch, run_toolbox
from ratchet.fleet.runs import (
    RunDocument,
    check_document_binding,
    decide_environment,
    document_digest,
    open_document,
    seal_document,
)
from ratchet.leasing import RunSnapshot
from ratchet.leasing.keyspace import check_id
from ratchet.runtime import (
    ApprovalClaims,
    ApprovalEvidence,
    Observation,
    Phase,
    RebaselineClaims,
    RebaselineDecision,
    ReviewDecision,
    ReviewDecisionClaims,
    ReviewVerdict,
    RunEngine,
    RunState,
    decisions,
    effects,
    machine,
    sign_approval,
    sign_rebaseline,
    sign_review_decision,
)
from ratchet.runtime.canonical import model_json
from ratchet.runtime.effects import drive
from ratchet.runtime.restore import open_checkpoint
from ratchet.runtime.state import TERMINAL_PHASES, ReviewCase
from ratchet.worker.executor import Executor

__all__ = [
    "CancelPosted",
    "Posted",
    "RunView",
    "approve",
    "cancel",
    "create_run",
    "inspect_run",
    "load_private_key",
    "observe_now",
    "post_approval",
    "post_review_decision",
    "rebaseline",
    "retry",
    "review",
    "review_claims",
    "submit",
]


def create_run(fleet: Fleet, document: RunDocument, *, run_id: str | None = None) -> str:
    """Create a run without enqueueing it: the signed document and generation 1 (which
    binds the document's digest) in one script call. Returns its id.

    The agent is resolved and built first, under the same rule a worker applies
    (:class:`ratchet.agents.AgentPolicy`), so a run whose agent no worker here
    could load is refused now rather than crash-looping later. Credentials the document
    names are checked against this process's own ``RATCHET_CREDENTIALS`` (the worker's
    rule, :func:`ratchet.fleet.runbuild.check_credentials`), and listing an MCP server's tools
    sends only what that map allows.

    Raises RunExistsError, ConfigurationError (agent not allowed or unloadable, bad
    environment, a credential refused), AdapterError, CheckpointTooLargeError.
    """
    run_id = check_id(run_id or f"run-{secrets.token_hex(6)}", "run_id")
    # Whether the workspace is a repository, and the host whose disk holds it, are decided
    # now, from the submitter's disk and settings, and signed with the document: no worker
    # decides them again.
    document = decide_environment(document, host=fleet.settings.host)
    fleet.check_eviction_policy()
    # The submitter's own credentials, by the worker's rule: a document naming one this
    # process does not define for that URL is refused before anything is sent or stored.
    check_credentials(document, fleet.credentials)
    fleet.agent_policy.build(document.agent, dict(document.agent_config))
    # A git environment's branch is made on its remote now, at the base resolved to a
    # commit; the document signs both.
    document = make_run_branch(
        document, run_id=run_id, state_dir=fleet.settings.state_dir, credentials=fleet.credentials
    )
    sent_at = time.monotonic()
    clock = StoreClock(fleet.store.server_time_ms(), sent_at=sent_at)  # the run's start
    # A stdio server the document names is checked against this process's declaration
    # of it and not started: the first worker job lists its tools (ratchet.fleet.mcp_servers).
    toolbox = run_toolbox(
        document, credentials=fleet.credentials, servers=fleet.settings.mcp_servers, start=False
    )
    # The run's tool ledger (in the store) is made here, before generation 1 observes it.
    adapter = build_adapter(
        document,
        toolbox=toolbox,
        store=fleet.store,
        run_id=run_id,
        create_ledger=True,
        state_dir=fleet.settings.state_dir,
        credentials=fleet.credentials,
    )
    try:
        RunEngine.start(
            run_id,
            scenario=document.scenario,
            keyring=fleet.keyring,
            executor=Executor(
                adapter, fleet.store.creator(seal_document(fleet.keyring, run_id, document))
            ),
            clock=clock,
            document_digest=document_digest(document),
            tools=toolbox.catalog,
        )
    finally:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()
    host = document.environment.host
    if host is not None:
        # The routing hint every enqueue reads (unsigned: a worker checks the signed
        # document's host before it opens anything, and routes a misrouted run on).
        fleet.store.hosts.set_run_host(run_id, host)
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
    """Read and verify a run. Raises RunNotFoundError (saying so for a purged run),
    CheckpointError, IntegrityError."""
    try:
        snap = fleet.store.read_run(run_id, with_checkpoint=True, with_scenario=True)
    except RunNotFoundError:
        tombstone = fleet.store.tombstone(run_id)
        if tombstone is None:
            raise
        export = tombstone.get("export") or "none"
        raise RunNotFoundError(
            f"the run was purged ({tombstone.get('phase', '?')}, "
            f"generation {tombstone.get('generation', '?')}; export: "
            f"{export})",
            run_id=run_id,
            purged=True,
        ) from None
    if snap.checkpoint is None or snap.scenario is None:
        raise IntegrityError("the run has no checkpoint or document", run_id=run_id)
    document = open_document(fleet.keyring, run_id, snap.scenario)
    payload = open_checkpoint(snap.checkpoint, keyring=fleet.keyring, archive=snap.archive)
    check_document_binding(payload.state, document)
    if payload.scenario_fingerprint != document.scenario.fingerprint:
        raise IntegrityError("the checkpoint was made under another scenario", run_id=run_id)
    if payload.generation != snap.generation:
        raise IntegrityError(
            "the checkpoint is not at the high-water mark",
            run_id=run_id,
            generation=payload.generation,
            high_water=snap.generation,
        )
    return RunView(
        snap, document, payload.state, payload.generation, fleet.store.records.incidents(run_id)
    )


@dataclass(frozen=True, slots=True)
class Posted:
    """Evidence left in a run's inbox. ``verified`` is False when no trust root was
    available here to check it (it was signed, not verified; the worker still checks)."""

    evidence: ApprovalEvidence | ReviewDecision | RebaselineDecision
    verified: bool


def _post(
    fleet: Fleet,
    run_id: str,
    evidence: ApprovalEvidence | ReviewDecision | RebaselineDecision,
    verified: bool,
    error: type[EvidenceError],
) -> Posted:
    """Refuse a nonce another run consumed (the store's global record), then leave the
    evidence in the run's inbox and re-enqueue the run."""
    nonce = evidence.claims.nonce
    holder = fleet.store.nonce_claimed_by(nonce)
    if holder is not None and holder != run_id:
        raise error(
            "the nonce was already consumed by another run", reason="replayed_nonce", nonce=nonce
        )
    fleet.store.records.post_evidence(run_id, model_json(evidence))
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
        machine.attach_approval(
            view.state,
            view.document.scenario,
            evidence,
            fleet.approvers,
            generation=view.generation,
            now=now,
        )
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
        decisions.check_review_decision(
            view.state, view.document.scenario, decision, fleet.reviewers
        )
    elif view.state.review is None:
        raise ReviewDecisionError("no review case is open", reason="no_open_case")
    return _post(fleet, run_id, decision, verified, ReviewDecisionError)


def approve(
    fleet: Fleet,
    run_id: str,
    action_id: str,
    *,
    key: Ed25519PrivateKey,
    approver_id: str,
    ttl_s: int = 3600,
    extra_proposals: int = 10,
) -> Posted:
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
        raise ContractError(
            "the pending write is another action",
            run_id=run_id,
            pending_action_id=pending.action.action_id,
        )
    env = state.environment
    claims = ApprovalClaims(
        task_id=state.task_id,
        run_id=run_id,
        policy_id=state.policy_id,
        policy_version=state.policy_version,
        action_id=action_id,
        idempotency_key=pending.action.idempotency_key or "",
        intent_digest=pending.intent_digest,
        env_instance_id=env.instance_id,
        env_fingerprint=env.fingerprint,
        env_version=env.version,
        generation=view.generation,
        nonce=f"ap-{secrets.token_hex(12)}",
        expires_at=fleet.store.server_time_ms() // 1000 + ttl_s,
        max_proposals=state.usage.proposals + extra_proposals,
    )
    return post_approval(fleet, run_id, sign_approval(key, approver_id, claims))


KeySource = Ed25519PrivateKey | Callable[[], Ed25519PrivateKey]
"""A signer's private key, or a function that loads it. Commands that observe the
environment first call the loader only after the observation is over and its adapter
closed: no process the observation started is alive while the key is in memory."""


def _loaded(key: KeySource) -> Ed25519PrivateKey:
    return key if isinstance(key, Ed25519PrivateKey) else key()


def review(fleet: Fleet, run_id: str, verdict: str, *, key: KeySource, reviewer_id: str) -> Posted:
    """Sign a reviewer decision on the run's open case, check it
    (:func:`post_review_decision`), post it and re-enqueue the run. ``key`` is loaded
    after the environment is observed (see :data:`KeySource`).

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
    # Bound to the environment as it is when the reviewer decides (the case's, or a later
    # one a person made while the run waited): the worker applies it only while it reads so.
    seen = observe_now(fleet, view)
    if seen.instance_id != case.environment.instance_id:
        raise ContractError("the environment is another instance than the case's", run_id=run_id)
    claims = review_claims(
        state,
        case,
        environment=seen,
        verdict=decided,
        nonce=f"rv-{secrets.token_hex(12)}",
    )
    decision = sign_review_decision(_loaded(key), reviewer_id, claims)
    return post_review_decision(fleet, run_id, decision)


def review_claims(
    state: RunState,
    case: ReviewCase,
    *,
    environment: Observation,
    verdict: ReviewVerdict,
    nonce: str,
) -> ReviewDecisionClaims:
    """What a reviewer signs to decide ``case`` of the run in ``state``, bound to
    ``environment`` (the worker applies the decision only while it observes exactly that
    instance and version)."""
    return ReviewDecisionClaims(
        task_id=state.task_id,
        run_id=state.run_id,
        policy_id=state.policy_id,
        policy_version=state.policy_version,
        case_id=case.case_id,
        action_id=case.pending.action.action_id,
        idempotency_key=case.pending.action.idempotency_key or "",
        pending_intent_digest=case.pending.intent_digest,
        receipt_intent_digest=case.receipt.intent_digest if case.receipt else None,
        receipt_fingerprint=case.receipt_fingerprint,
        env_instance_id=environment.instance_id,
        env_version=environment.version,
        verdict=verdict,
        nonce=nonce,
    )


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
        raise ContractError(
            f"a worker holds the run ({view.snapshot.owner}); nothing to retry", run_id=run_id
        )
    fleet.store.records.record_incident(
        run_id,
        {
            "kind": "operator_retry",
            "operator": operator[:100],
            "reason": reason[:500],
            "phase": phase.value,
        },
    )
    fleet.enqueue(run_id)


@dataclass(frozen=True, slots=True)
class CancelPosted:
    """A cancel request left for the workers: its id, the run's phase when it was made,
    and the worker holding the run then ("" when none does)."""

    request: CancelRequest
    phase: str
    held_by: str


def cancel(fleet: Fleet, run_id: str, *, reason: str, operator: str) -> CancelPosted:
    """Ask the workers to end a run at its next safe point (see
    :mod:`ratchet.fleet.control` for the whole protocol): verify the run, leave a cancel
    request sealed under the fleet's key ring in its inbox, and re-enqueue it. A worker
    stepping it stops at its next guard; a waiting, queued or frozen run is cancelled by
    the next worker to take it. The worker commits ``cancelled`` through the fenced path,
    after settling any pending write by its key, attributed to ``operator``.

    Raises ContractError (an empty reason, a run that is terminal, one under review: a
    reviewer decides it with ``abort``), and what :func:`inspect_run` raises (a run that
    does not verify is not touched).
    """
    view = inspect_run(fleet, run_id)
    phase = view.state.phase
    if phase in TERMINAL_PHASES:
        raise ContractError(f"the run is {phase.value}; nothing to cancel", run_id=run_id)
    if phase is Phase.NEEDS_REVIEW:
        raise ContractError(
            "the run is under review: a reviewer ends it (ratchet review RUN --decision abort)",
            run_id=run_id,
        )
    request = new_cancel_request(
        run_id, by=operator, reason=reason, now_ms=fleet.store.server_time_ms()
    )
    fleet.store.records.post_evidence(run_id, seal_cancel(fleet.keyring, request))
    fleet.enqueue(run_id)
    return CancelPosted(
        request, phase.value, (view.snapshot.owner or "") if view.snapshot.lease_live else ""
    )


def _environment_incident(view: RunView, incident_id: str | None) -> str:
    """The id of the incident a rebaseline resolves: the one named, or the newest that
    reports a changed environment. Raises ContractError."""
    for incident in view.incidents:  # newest first
        found = str(incident.get("id") or f"at-{incident.get('at_ms')}")
        if incident_id is not None:
            if found == incident_id:
                return found
            continue
        reason = str(incident.get("reason", ""))
        if incident.get("kind") == "environment_changed" or (
            incident.get("kind") == "restore_refused" and reason == "environment"
        ):
            return found
    if incident_id is not None:
        raise ContractError(f"the run has no incident {incident_id}", field="incident")
    raise ContractError(
        "no incident of this run reports a changed environment; nothing to rebaseline",
        field="incident",
    )


def observe_now(fleet: Fleet, view: RunView) -> Observation:
    """The run's environment as it is now, read-only through its own adapter (no fence is
    raised: nothing is written; no verifier runs, so no sandbox is needed; the
    repository is read as data, so nothing the workspace configures runs on the
    operator's host). Raises AdapterError, ConfigurationError."""
    token = fleet.settings.http_token.get_secret_value() if fleet.settings.http_token else None
    adapter = build_adapter(
        view.document,
        http_token=token,
        toolbox=run_toolbox(
            view.document,
            credentials=fleet.credentials,
            servers=fleet.settings.mcp_servers,
            start=False,
        ),
        recorded=view.state.environment,
        store=fleet.store,
        run_id=view.state.run_id,
        state_dir=fleet.settings.state_dir,
        credentials=fleet.credentials,
    )
    try:
        return drive(effects.observe(), Executor(adapter))
    finally:
        close = getattr(adapter, "close", None)
        if callable(close):
            close()


def rebaseline(
    fleet: Fleet,
    run_id: str,
    *,
    key: KeySource,
    reviewer_id: str,
    incident_id: str | None = None,
) -> Posted:
    """Sign a reviewer's rebaseline decision for a run frozen because its environment was
    changed behind it: observe the environment now (read-only, through the run's
    adapter; ``key`` is loaded only after that, see :data:`KeySource`), bind the decision
    to the run, the incident, the checkpoint generation, the environment the run recorded
    and the one observed, check it as the worker will, post it and re-enqueue the run.
    The worker accepts the observation as the new baseline only while the environment
    still reads exactly that, and voids the old approvals.

    Raises ContractError (a run not running or waiting, no environment incident, an
    environment that did not change or is another instance), ReviewDecisionError, and
    what :func:`inspect_run` raises.
    """
    view = inspect_run(fleet, run_id)
    state = view.state
    if state.phase not in (Phase.RUNNING, Phase.AWAITING_APPROVAL):
        raise ContractError(f"a {state.phase.value} run is not rebaselined", run_id=run_id)
    incident = _environment_incident(view, incident_id)
    seen = observe_now(fleet, view)
    env = state.environment
    if seen.same_state(env):
        raise ContractError(
            "the environment is the one the run recorded; nothing to "
            "rebaseline (ratchet retry RUN hands it back)",
            run_id=run_id,
        )
    if seen.instance_id != env.instance_id:
        raise ContractError(
            "the environment is another instance; a rebaseline keeps the "
            "instance (submit a new run instead)",
            run_id=run_id,
        )
    if seen.version < env.version:
        raise ContractError(
            f"the environment is behind the run's record of it (version {seen.version} < "
            f"{env.version}): restored from an older copy? A rebaseline never moves it "
            "back; restore the newer copy, or cancel the run",
            run_id=run_id,
        )
    claims = RebaselineClaims(
        task_id=state.task_id,
        run_id=run_id,
        policy_id=state.policy_id,
        policy_version=state.policy_version,
        incident_id=incident,
        generation=view.generation,
        old_env_instance_id=env.instance_id,
        old_env_version=env.version,
        old_env_fingerprint=env.fingerprint,
        new_env_instance_id=seen.instance_id,
        new_env_version=seen.version,
        new_env_fingerprint=seen.fingerprint,
        nonce=f"rb-{secrets.token_hex(12)}",
    )
    decision = sign_rebaseline(_loaded(key), reviewer_id, claims)
    verified = fleet.reviewers is not None
    if fleet.reviewers is not None:
        decisions.check_rebaseline(
            state, view.document.scenario, decision, fleet.reviewers, generation=view.generation
        )
    return _post(fleet, run_id, decision, verified, ReviewDecisionError)


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM. Raises ConfigurationError."""
    try:
        key = load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise ConfigurationError("the key file is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigurationError("the key file is not an Ed25519 private key")
    return key
