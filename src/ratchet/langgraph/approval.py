"""Human approval for LangGraph's ``interrupt()``: the resume value is a signed approval
bound to the intent digest of the exact action, checked before LangGraph stores it.

A node that needs approval interrupts with an :func:`approval_request` (the binding an
approver must sign: task, thread as run id, policy, action, idempotency key, intent digest,
environment). The operator resumes with :meth:`ApprovalGate.resume`, which checks, in
order, before anything reaches the checkpointer:

1. the evidence parses strictly (ratchet's ``ApprovalEvidence``);
2. its Ed25519 signature verifies under a trusted, unrevoked approver key (workers hold
   only public keys);
3. every bound claim equals the pending request of the thread (the exact action: a
   different action, key, amount or environment has another intent digest);
4. it has not expired (``now`` is an argument; the caller's clock decides only expiry);
5. its nonce is claimed once, in Redis (``SET NX``), for this thread and intent digest.

Only then is ``Command(resume=...)`` passed to the graph, so the approval LangGraph stores
as the interrupt's resume value is one that passed every check. When the node runs again
from its start, :meth:`ApprovalGate.confirm` re-checks signature, binding and that the
nonce was claimed for this thread and intent, so a resume value written around the gate is
refused too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langgraph.types import Command
from pydantic import ValidationError

from ratchet.errors import ApprovalError, ContractError, NonceReplayError
from ratchet.langgraph.keyspace import nonce_key
from ratchet.runtime.evidence import ApprovalClaims, ApprovalEvidence, TrustRoots

__all__ = ["BOUND_FIELDS", "REQUEST_KIND", "ApprovalGate", "approval_request"]

REQUEST_KIND = "ratchet.approval_request"
BOUND_FIELDS = (
    "task_id",
    "run_id",
    "policy_id",
    "policy_version",
    "action_id",
    "idempotency_key",
    "intent_digest",
    "env_instance_id",
    "env_fingerprint",
    "env_version",
    "generation",
)


def approval_request(**fields: Any) -> dict[str, Any]:
    """The interrupt value of a node that needs approval: exactly :data:`BOUND_FIELDS`.

    Raises ContractError for a missing or unexpected field.
    """
    if set(fields) != set(BOUND_FIELDS):
        raise ContractError(
            "an approval request names exactly the bound fields",
            field="approval_request",
            missing=sorted(set(BOUND_FIELDS) - set(fields)),
            unexpected=sorted(set(fields) - set(BOUND_FIELDS)),
        )
    return {"kind": REQUEST_KIND, **fields}


def _evidence(value: Any) -> ApprovalEvidence:
    if isinstance(value, ApprovalEvidence):
        return value
    try:
        return ApprovalEvidence.model_validate(value)
    except ValidationError:
        raise ApprovalError("the resume value is not an approval", reason="malformed") from None


class ApprovalGate:
    """Checks approvals for interrupted threads. ``client`` is a sync Redis client
    (``decode_responses=False``) for the nonce records; ``nonce_ttl_s`` bounds how long
    they live (None: for good; set it above the longest approval lifetime if at all)."""

    def __init__(self, trust: TrustRoots, client: Any, *, nonce_ttl_s: int | None = None) -> None:
        self._trust = trust
        self._client = client
        self._nonce_ttl_s = nonce_ttl_s

    def __repr__(self) -> str:
        return f"ApprovalGate(trust={self._trust!r})"

    def _verify(
        self, evidence: ApprovalEvidence, request: Mapping[str, Any], *, now: int | None
    ) -> ApprovalClaims:
        self._trust.verify_approval(evidence)
        claims = evidence.claims
        if request.get("kind") != REQUEST_KIND:
            raise ApprovalError("the interrupt is not an approval request", reason="binding")
        for name in BOUND_FIELDS:
            if getattr(claims, name) != request.get(name):
                raise ApprovalError(
                    f"the approval is bound to another {name}", reason="binding", field=name
                )
        if now is not None and claims.expired(now=now, proposals_used=0):
            raise ApprovalError(
                "the approval has expired", reason="expired", expires_at=claims.expires_at
            )
        return claims

    def check(
        self, value: Any, request: Mapping[str, Any], *, thread_id: str, now: int
    ) -> ApprovalEvidence:
        """Run checks 1-5 and consume the nonce. Raises ApprovalError (``reason``:
        malformed, unknown_signer, revoked_signer, bad_signature, binding, expired) or
        NonceReplayError. Re-checking the same approval for the same thread and intent is
        allowed (a resume retried after a crash)."""
        evidence = _evidence(value)
        claims = self._verify(evidence, request, now=now)
        owner = f"{thread_id}|{claims.intent_digest}".encode()
        key = nonce_key(claims.nonce)
        claimed = self._client.set(key, owner, nx=True, ex=self._nonce_ttl_s)
        if not claimed and self._client.get(key) != owner:
            raise NonceReplayError(
                "the approval nonce was already used", nonce=claims.nonce, thread_id=thread_id
            )
        return evidence

    def confirm(
        self, value: Any, request: Mapping[str, Any], *, thread_id: str
    ) -> ApprovalEvidence:
        """Inside the node after ``interrupt()`` returned: signature and binding again, and
        the nonce claimed by :meth:`check` for this thread and intent. Raises ApprovalError,
        NonceReplayError."""
        evidence = _evidence(value)
        claims = self._verify(evidence, request, now=None)
        owner = f"{thread_id}|{claims.intent_digest}".encode()
        if self._client.get(nonce_key(claims.nonce)) != owner:
            raise NonceReplayError(
                "the approval was not checked for this thread",
                nonce=claims.nonce,
                thread_id=thread_id,
            )
        return evidence

    def resume(
        self, graph: Any, config: Mapping[str, Any], value: Any, *, now: int, **invoke: Any
    ) -> Any:
        """Check ``value`` against the thread's one pending approval request, then resume
        the graph with it. Raises ContractError when the thread waits on no approval (or on
        several), plus everything :meth:`check` raises."""
        thread_id = str(config["configurable"]["thread_id"])
        state = graph.get_state(config)
        pending = [
            i
            for i in state.interrupts
            if isinstance(i.value, Mapping) and i.value.get("kind") == REQUEST_KIND
        ]
        if len(pending) != 1:
            raise ContractError(
                "the thread is not waiting on exactly one approval",
                field="interrupts",
                pending=len(pending),
            )
        evidence = self.check(value, pending[0].value, thread_id=thread_id, now=now)
        resume = {pending[0].id: evidence.model_dump(mode="json")}
        return graph.invoke(Command(resume=resume), config, **invoke)
