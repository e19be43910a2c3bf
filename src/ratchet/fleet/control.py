"""Operator controls a worker carries out: cancel requests and rebaseline decisions.

Both travel through the run's inbox (the bounded list ``ratchet approve`` and ``ratchet
review`` use) and are acted on by a worker holding the run's lease, through the fenced
commit path. Nothing an operator's command does writes a checkpoint itself; the Redis
``operator`` role cannot acquire or commit, and does not need to.

Cancel, end to end:

1. ``ratchet cancel RUN --reason R`` (:func:`ratchet.ops.cancel`) verifies the run,
   refuses one that is terminal or under review (a reviewer decides those: ``ratchet
   review RUN --decision abort``), and leaves a :class:`CancelRequest` in the inbox: an
   HMAC envelope under the fleet's key ring in its own domain (``ratchet/control/v1``),
   naming the run, a request id, who asked, why, and when by the store's clock. The run is
   re-enqueued.
2. A worker finds it when a job starts, right after the checkpoint and the run document
   verify and before an agent is loaded (so a run whose agent cannot be imported can
   still be cancelled), and, while it steps a run, at the loop's guard (the inbox is
   re-read at most every ``renew_interval_ms``): the run stops at its next safe point.
3. :meth:`ratchet.runtime.RunEngine.cancel` settles a pending write by its key behind the
   worker's own fence (recorded as executed if the adapter holds its receipt, dropped if
   it holds none, a review case if the answer does not settle it) and commits
   ``cancelled``, attributed (``by``, ``request_id``) in the signed trace. A restore that
   refuses only the environment (a workspace edited behind the run) is tolerated for
   this, since a cancel writes nothing; the trace records the environment seen.

A request that does not verify (forged, another run's, another key's) is never acted on;
the job records a ``control_refused`` incident for it.

Rebaseline: a reviewer's Ed25519-signed :class:`~ratchet.runtime.RebaselineDecision`
(``ratchet review RUN --decision rebaseline``), checked against the opened checkpoint
before the restore compares environments; see :func:`find_rebaseline`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, Strict, ValidationError

from ratchet.errors import CheckpointError, ContractError, EvidenceError
from ratchet.runtime import KeyRing, RebaselineDecision, RunState, Scenario, TrustRoots
from ratchet.runtime.canonical import Domain, canonical_json, strict_json_loads
from ratchet.runtime.decisions import check_rebaseline
from ratchet.runtime.signing import open_envelope, seal_envelope
from ratchet.runtime.types import Frozen, Identifier, NonNegInt

__all__ = [
    "CancelRequest",
    "Controls",
    "find_controls",
    "find_rebaseline",
    "new_cancel_request",
    "seal_cancel",
]


class CancelRequest(Frozen):
    """An operator's request to end a run, sealed under the fleet's key ring."""

    kind: Literal["cancel"] = "cancel"
    run_id: Identifier
    request_id: Identifier
    by: Annotated[str, Strict(), Field(min_length=1, max_length=200)]
    reason: Annotated[str, Strict(), Field(min_length=1, max_length=1024)]
    requested_at_ms: NonNegInt


def new_cancel_request(run_id: str, *, by: str, reason: str, now_ms: int) -> CancelRequest:
    """A request with a fresh id. Raises ContractError for an empty reason or operator."""
    try:
        return CancelRequest(
            run_id=run_id,
            request_id=f"cx-{secrets.token_hex(8)}",
            by=by.strip()[:200],
            reason=reason.strip()[:1024],
            requested_at_ms=now_ms,
        )
    except ValidationError as exc:
        field = ".".join(str(p) for p in exc.errors()[0]["loc"]) or "request"
        raise ContractError(
            f"bad cancel request: {field} is empty or invalid", field=field
        ) from None


def seal_cancel(keyring: KeyRing, request: CancelRequest) -> bytes:
    """The inbox entry for ``request``: an envelope in the control domain."""
    body = canonical_json(request.model_dump(mode="json"))
    return seal_envelope(keyring, body, domain=Domain.CONTROL)


def _is_envelope(raw: bytes) -> bool:
    # Evidence (approvals, decisions) is one line of JSON; an envelope is a header line.
    return raw.startswith(b"{") and b"\n" in raw[:4096]


@dataclass(frozen=True, slots=True)
class Controls:
    """What a run's inbox asks of the worker: the first valid cancel request (None: none),
    and why each control entry that did not verify was refused."""

    cancel: CancelRequest | None
    refused: tuple[str, ...] = ()


def find_controls(keyring: KeyRing, run_id: str, inbox: list[bytes]) -> Controls:
    """Open the control entries of ``inbox`` (newest first). An entry is acted on only if
    its MAC verifies under the ring, it parses strictly, and it names this run."""
    found: CancelRequest | None = None
    refused: list[str] = []
    for raw in inbox:
        if not _is_envelope(raw):
            continue
        try:
            body = open_envelope(keyring, raw, domain=Domain.CONTROL)
            request = CancelRequest.model_validate(strict_json_loads(body))
        except CheckpointError as exc:
            refused.append(f"does not verify ({exc.reason or 'malformed'})")
            continue
        except (ContractError, ValidationError):
            refused.append("its signed body is not a cancel request")
            continue
        if request.run_id != run_id:
            refused.append("it was made for another run")
            continue
        if found is None:
            found = request
    return Controls(found, tuple(refused))


def find_rebaseline(
    inbox: list[bytes],
    state: RunState,
    scenario: Scenario,
    reviewers: TrustRoots | None,
    *,
    generation: int,
) -> tuple[RebaselineDecision | None, list[str]]:
    """The first rebaseline decision in ``inbox`` that passes every check that needs no
    adapter against the opened (not yet restored) checkpoint, and why others failed.

    Only then may the restore accept the environment it names: the worker observes it
    under its fence and :meth:`ratchet.runtime.RunEngine.apply_rebaseline` checks it is
    exactly that environment before anything is committed.
    """
    refused: list[str] = []
    for raw in inbox:
        if _is_envelope(raw) or b'"old_env_fingerprint"' not in raw:
            continue
        try:
            decision = RebaselineDecision.model_validate_json(raw)
        except ValidationError:
            refused.append("not a well-formed rebaseline decision")
            continue
        if decision.claims.nonce in state.consumed_nonces:
            continue
        if reviewers is None:
            refused.append("no reviewer trust root is configured")
            continue
        try:
            check_rebaseline(state, scenario, decision, reviewers, generation=generation)
        except EvidenceError as exc:
            refused.append(exc.message)
            continue
        return decision, refused
    return None, refused
