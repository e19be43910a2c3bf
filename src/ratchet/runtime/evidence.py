"""Signed human evidence: approvals of a pending write and reviewer decisions.

Both are Ed25519 signatures (the ``cryptography`` package) over domain-separated canonical
JSON of their claims and the signer's id. Workers hold only public keys
(:class:`TrustRoots`), so a compromised worker cannot forge a human's approval. Approvers
and reviewers are separate trust roots: an approver key cannot sign a review decision.

An approval binds task, run, policy, action, idempotency key, intent digest, environment
instance, fingerprint and version, the checkpoint generation it was issued against, a
one-time nonce, and an expiry both by wall clock and by proposal count. A review decision
binds task, run, policy, case, action, key, both intent digests, the full receipt
fingerprint, the environment version and a nonce. A rebaseline decision (a reviewer's,
for a run frozen because its environment was changed behind it) binds task, run, policy,
the incident that reported the change, the checkpoint generation, the environment the run
last recorded and the one observed when the decision was made (instance, version and
fingerprint of each) and a nonce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ratchet.errors import ApprovalError, ConfigurationError, EvidenceError, ReviewDecisionError
from ratchet.runtime.canonical import Domain, canonical_json, model_digest
from ratchet.runtime.types import Digest, Frozen, Identifier, NonNegInt, SignatureHex

__all__ = [
    "ApprovalClaims",
    "ApprovalEvidence",
    "RebaselineClaims",
    "RebaselineDecision",
    "ReviewDecision",
    "ReviewDecisionClaims",
    "ReviewVerdict",
    "TrustRoots",
    "sign_approval",
    "sign_rebaseline",
    "sign_review_decision",
]


class ApprovalClaims(Frozen):
    task_id: Identifier
    run_id: Identifier
    policy_id: Identifier
    policy_version: Identifier
    action_id: Identifier
    idempotency_key: Identifier
    intent_digest: Digest
    env_instance_id: Identifier
    env_fingerprint: Digest
    env_version: NonNegInt
    generation: NonNegInt
    nonce: Identifier
    expires_at: NonNegInt
    max_proposals: NonNegInt

    def expired(self, *, now: int, proposals_used: int) -> bool:
        """Expired once the wall clock passes ``expires_at`` or proposals pass the cap."""
        return now > self.expires_at or proposals_used > self.max_proposals


class ApprovalEvidence(Frozen):
    claims: ApprovalClaims
    approver_id: Identifier
    signature: SignatureHex

    @property
    def digest(self) -> str:
        """What adapters bind into receipts: digest of claims, signer and signature."""
        return model_digest(Domain.APPROVAL, self)


class ReviewVerdict(StrEnum):
    REPLAN = "replan"
    ABORT = "abort"


class ReviewDecisionClaims(Frozen):
    task_id: Identifier
    run_id: Identifier
    policy_id: Identifier
    policy_version: Identifier
    case_id: Identifier
    action_id: Identifier
    idempotency_key: Identifier
    pending_intent_digest: Digest
    receipt_intent_digest: Digest | None
    receipt_fingerprint: Digest | None
    env_instance_id: Identifier
    env_version: NonNegInt
    verdict: ReviewVerdict
    nonce: Identifier


class ReviewDecision(Frozen):
    claims: ReviewDecisionClaims
    reviewer_id: Identifier
    signature: SignatureHex


class RebaselineClaims(Frozen):
    """What a reviewer signs to make the environment as now observed a frozen run's new
    baseline. ``old_*`` is the environment the run's checkpoint (at ``generation``)
    recorded, ``new_*`` the one observed when the decision was made."""

    task_id: Identifier
    run_id: Identifier
    policy_id: Identifier
    policy_version: Identifier
    incident_id: Identifier
    generation: NonNegInt
    old_env_instance_id: Identifier
    old_env_version: NonNegInt
    old_env_fingerprint: Digest
    new_env_instance_id: Identifier
    new_env_version: NonNegInt
    new_env_fingerprint: Digest
    nonce: Identifier


class RebaselineDecision(Frozen):
    claims: RebaselineClaims
    reviewer_id: Identifier
    signature: SignatureHex


def _message(domain: bytes, signer: str, claims: Frozen) -> bytes:
    body = canonical_json({"signer": signer, "claims": claims.model_dump(mode="json")})
    return domain + b"\x00" + body


@dataclass(frozen=True, slots=True)
class TrustRoots:
    """Public keys of trusted signers, by signer id. One instance per role."""

    role: str
    keys: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()

    @classmethod
    def from_public_bytes(
        cls, role: str, keys: Mapping[str, bytes], revoked: frozenset[str] = frozenset()
    ) -> TrustRoots:
        """Build trust roots from raw 32-byte Ed25519 public keys. Raises ConfigurationError."""
        parsed: dict[str, Ed25519PublicKey] = {}
        for signer, raw in keys.items():
            try:
                parsed[signer] = Ed25519PublicKey.from_public_bytes(raw)
            except ValueError:
                raise ConfigurationError(
                    f"{role} key for {signer!r} is not an Ed25519 public key", signer=signer
                ) from None
        return cls(role, parsed, revoked)

    def __repr__(self) -> str:
        return f"TrustRoots(role={self.role!r}, signers={sorted(self.keys)!r})"

    def verify(
        self,
        domain: bytes,
        signer: str,
        claims: Frozen,
        signature_hex: str,
        error: type[EvidenceError],
        *,
        allow_revoked: bool = False,
    ) -> None:
        """Verify one signature. ``allow_revoked`` is for sealed, historical evidence that
        was verified when it was used: a later revocation does not unmake it."""
        key = self.keys.get(signer)
        if key is None:
            raise error(f"unknown {self.role} {signer!r}", reason="unknown_signer", signer=signer)
        if signer in self.revoked and not allow_revoked:
            raise error(
                f"{self.role} {signer!r} is revoked", reason="revoked_signer", signer=signer
            )
        try:
            key.verify(bytes.fromhex(signature_hex), _message(domain, signer, claims))
        except (InvalidSignature, ValueError):
            raise error(
                f"signature by {self.role} {signer!r} does not verify",
                reason="bad_signature",
                signer=signer,
            ) from None

    def verify_approval(self, evidence: ApprovalEvidence, *, allow_revoked: bool = False) -> None:
        """Raises ApprovalError (``reason``: unknown_signer, revoked_signer, bad_signature)."""
        self.verify(
            Domain.APPROVAL,
            evidence.approver_id,
            evidence.claims,
            evidence.signature,
            ApprovalError,
            allow_revoked=allow_revoked,
        )

    def verify_review(self, decision: ReviewDecision, *, allow_revoked: bool = False) -> None:
        """Raises ReviewDecisionError (same reasons as :meth:`verify_approval`)."""
        self.verify(
            Domain.REVIEW,
            decision.reviewer_id,
            decision.claims,
            decision.signature,
            ReviewDecisionError,
            allow_revoked=allow_revoked,
        )

    def verify_rebaseline(
        self, decision: RebaselineDecision, *, allow_revoked: bool = False
    ) -> None:
        """Raises ReviewDecisionError (same reasons as :meth:`verify_approval`)."""
        self.verify(
            Domain.REBASELINE,
            decision.reviewer_id,
            decision.claims,
            decision.signature,
            ReviewDecisionError,
            allow_revoked=allow_revoked,
        )

    def is_revoked(self, signer: str) -> bool:
        return signer in self.revoked


def sign_approval(
    private_key: Ed25519PrivateKey, approver_id: str, claims: ApprovalClaims
) -> ApprovalEvidence:
    """Sign approval claims (control plane / CLI side; workers never hold private keys)."""
    sig = private_key.sign(_message(Domain.APPROVAL, approver_id, claims))
    return ApprovalEvidence(claims=claims, approver_id=approver_id, signature=sig.hex())


def sign_review_decision(
    private_key: Ed25519PrivateKey, reviewer_id: str, claims: ReviewDecisionClaims
) -> ReviewDecision:
    """Sign a reviewer decision (reviewer side)."""
    sig = private_key.sign(_message(Domain.REVIEW, reviewer_id, claims))
    return ReviewDecision(claims=claims, reviewer_id=reviewer_id, signature=sig.hex())


def sign_rebaseline(
    private_key: Ed25519PrivateKey, reviewer_id: str, claims: RebaselineClaims
) -> RebaselineDecision:
    """Sign a rebaseline decision (reviewer side)."""
    sig = private_key.sign(_message(Domain.REBASELINE, reviewer_id, claims))
    return RebaselineDecision(claims=claims, reviewer_id=reviewer_id, signature=sig.hex())
