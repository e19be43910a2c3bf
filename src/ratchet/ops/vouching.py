"""What a run's export vouches for, part by part (``ratchet verify``).

An export holds parts of two kinds, and :func:`~ratchet.ops.retention.verify_export`
reports each (:class:`PartReport`):

* **signed** as a whole: the run document, the checkpoint and its archive (HMAC under the
  key ring, the archive's hash chain signed in the checkpoint), and the consumed nonces
  (inside the signed checkpoint). Anything wrong with them refuses the whole export.
* **records** that Redis holds one by one, exported exactly as it held them, each judged
  here on its own (:class:`RecordReport`, ``status``):

  - ``sealed``: an HMAC seal under the key ring that verifies for this run (incidents,
    sealed as they are written: :mod:`ratchet.runtime.seals`; cancel requests, sealed by
    ``ratchet cancel``: :mod:`ratchet.fleet.control`);
  - ``signed``: an approval or reviewer decision whose Ed25519 signature verifies under
    the approver or reviewer trust roots given, and whose claims name this run;
  - ``unchecked``: it carries a seal or signature that cannot be checked here (a key id
    or signer these keys do not hold, a retired key, no trust roots given);
  - ``unsigned``: no seal at all (every history entry: the commit script writes them
    unsigned; incidents written before they were sealed; anything pushed by hand);
  - ``forged``: evidence whose signature does not verify, or that names another run
    (the operator's ``ratchet approve`` posts evidence it could not check when it has no
    trust roots, so this is reported, not refused).

  A record with an HMAC seal that does not verify (changed after it was sealed, or copied
  from another run) refuses the whole export: only a key holder seals, always correctly,
  so a broken seal is the store's records having been changed.

Only ``sealed`` and ``signed`` records are vouched for. Which records a part holds (none
dropped, reordered or repeated) is never vouched for: it is what the store held.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from ratchet.errors import CheckpointError, ContractError, EvidenceError, IntegrityError
from ratchet.fleet.control import CancelRequest
from ratchet.runtime import (
    ApprovalEvidence,
    KeyRing,
    RebaselineDecision,
    ReviewDecision,
    TrustRoots,
)
from ratchet.runtime.canonical import Domain, strict_json_loads
from ratchet.runtime.seals import SealVerdict, check_record_seal
from ratchet.runtime.signing import open_envelope

__all__ = [
    "VOUCHED",
    "PartReport",
    "RecordReport",
    "judge_history",
    "judge_inbox",
    "judge_incidents",
    "signed_part",
]

#: The record statuses that vouch for a record.
VOUCHED = frozenset({"sealed", "signed"})
_TEXT = 120
_MS = re.compile(r"[0-9]{1,19}")  # a count or a time in ms, as the scripts write them


def _number(text: str) -> int | None:
    return int(text) if _MS.fullmatch(text) else None


def clean(value: object, limit: int = _TEXT) -> str:
    """Stored text as it may be shown: printable characters only, bounded."""
    text = "" if value is None else str(value)
    shown = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return shown if len(shown) <= limit else shown[:limit] + "..."


@dataclass(frozen=True, slots=True)
class RecordReport:
    """One stored record of a part, as judged (see the module docstring). ``kind``,
    ``ident``, ``by`` and ``at_ms`` are what the record itself says (shown bounded and
    printable), vouched for only when ``status`` is ``sealed`` or ``signed``."""

    index: int  # its position in the part as stored (0: the newest)
    status: str
    kind: str = ""
    ident: str = ""
    by: str = ""
    at_ms: int | None = None
    note: str = ""  # why it is not vouched for ("" when it is)

    @property
    def vouched(self) -> bool:
        return self.status in VOUCHED

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "status": self.status,
            "vouched": self.vouched,
            "kind": self.kind,
            "id": self.ident,
            "by": self.by,
            "at_ms": self.at_ms,
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class PartReport:
    """One part of an export: whether everything in it is vouched for, whether the
    export vouches that none of it is missing (``complete``), and by what."""

    name: str
    vouched: bool
    complete: bool
    by: str
    count: int
    records: tuple[RecordReport, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "vouched": self.vouched,
            "complete": self.complete,
            "by": self.by,
            "count": self.count,
        }
        if self.name in RECORD_PARTS:
            out["records"] = [record.as_dict() for record in self.records]
            out["statuses"] = {
                status: sum(r.status == status for r in self.records)
                for status in sorted({r.status for r in self.records})
            }
        return out


RECORD_PARTS = ("history", "incidents", "inbox")
_AS_STORED = "which exist as the store held them"


def signed_part(name: str, by: str, count: int) -> PartReport:
    """A part the export's signed content vouches for whole."""
    return PartReport(name, True, True, by, count)


def _refused(message: str, check: str, **context: Any) -> IntegrityError:
    return IntegrityError(f"export refused: {message}", reason="export", check=check, **context)


def _records_part(name: str, records: list[RecordReport], what: str) -> PartReport:
    vouched = all(r.vouched for r in records)
    done = sum(r.vouched for r in records)
    by = f"{done} of {len(records)} {what}; {_AS_STORED}"
    return PartReport(name, vouched, False, by, len(records), tuple(records))


# --- history ------------------------------------------------------------------------------


def judge_history(entries: list[str]) -> PartReport:
    """The commit index the commit script keeps (``generation|state_version|
    lease_version|owner|commit_id|digest|at_ms``): unsigned, every entry of it. The signed
    checkpoint and its archive are the run's record; this only says what the store said."""
    records = []
    for index, entry in enumerate(entries):
        parts = entry.split("|")
        commit = len(parts) == 7 and all(_number(parts[i]) is not None for i in (0, 1, 2, 6))
        records.append(
            RecordReport(
                index,
                "unsigned",
                kind="commit" if commit else "unknown",
                ident=clean(parts[4]) if commit else clean(entry, 80),
                by=clean(parts[3]) if commit else "",
                at_ms=_number(parts[6]) if commit else None,
                note="unsigned: as read from the store"
                + ("" if commit else "; not a commit entry"),
            )
        )
    return PartReport(
        "history",
        False,
        False,
        "unsigned: the store's commit index (the checkpoint and archive are the signed record)",
        len(records),
        tuple(records),
    )


# --- incidents ----------------------------------------------------------------------------


def _incident(raw: Any) -> tuple[dict[str, Any] | None, int | None]:
    """A stored incident (format 2: ``at_ms|json`` as the store holds it; format 1: the
    object as read, with ``at_ms``) as its record and the store's time stamp."""
    if isinstance(raw, dict):
        record = {k: v for k, v in raw.items() if k != "at_ms"}
        at = raw.get("at_ms")
        return record, at if isinstance(at, int) and not isinstance(at, bool) else None
    if not isinstance(raw, str):
        return None, None
    at, _, body = raw.partition("|")
    try:
        parsed = strict_json_loads(body)
    except ContractError:
        parsed = None
    return (parsed if isinstance(parsed, dict) else None), _number(at)


def judge_incidents(keyring: KeyRing, run_id: str, stored: list[Any]) -> PartReport:
    """Each incident by its seal (:func:`~ratchet.runtime.seals.check_record_seal`).

    Raises IntegrityError (``check="incident_seal"``): an incident whose seal does not
    verify.
    """
    records = []
    for index, raw in enumerate(stored):
        record, at_ms = _incident(raw)
        if record is None:
            records.append(
                RecordReport(
                    index,
                    "unsigned",
                    "unreadable",
                    clean(raw, 80),
                    at_ms=at_ms,
                    note="unsigned: not a JSON record",
                )
            )
            continue
        check = check_record_seal(keyring, run_id, record)
        kind, ident = clean(record.get("kind"), 60), clean(record.get("id"), 60)
        if check.verdict is SealVerdict.BROKEN:
            raise _refused(
                f"incident #{index} ({kind} {ident}) {check.reason}",
                "incident_seal",
                index=index,
            )
        by = record.get("operator") if record.get("kind") == "operator_retry" else None
        records.append(
            RecordReport(
                index,
                check.verdict.value,
                kind,
                ident,
                clean(by, 100),
                at_ms,
                "" if check.verdict is SealVerdict.SEALED else f"{check.verdict}: {check.reason}",
            )
        )
    return _records_part(
        "incidents", records, "sealed (HMAC, key ring; the store's time beside each is not)"
    )


# --- inbox --------------------------------------------------------------------------------


def _is_envelope(raw: bytes) -> bool:
    # As the worker tells them apart (ratchet.fleet.control): an envelope has a header line.
    return raw.startswith(b"{") and b"\n" in raw[:4096]


def _control(keyring: KeyRing, run_id: str, index: int, raw: bytes) -> RecordReport:
    try:
        body = open_envelope(keyring, raw, domain=Domain.CONTROL)
    except CheckpointError as exc:
        reason = exc.reason or "malformed"
        if reason in ("checksum", "bad_mac"):
            raise _refused(
                f"inbox entry #{index} is a sealed request whose seal does not verify ({reason})",
                "inbox_seal",
                index=index,
            ) from None
        status = "unsigned" if reason == "malformed" else "unchecked"
        note = "not a sealed request" if status == "unsigned" else f"its seal: {reason}"
        excerpt = clean(raw.decode("utf-8", "replace"), 80)
        return RecordReport(index, status, "unknown", excerpt, note=f"{status}: {note}")
    try:
        request = CancelRequest.model_validate(strict_json_loads(body))
    except (ContractError, ValidationError):
        return RecordReport(
            index, "unchecked", "control", note="unchecked: sealed, but not a request read here"
        )
    if request.run_id != run_id:
        raise _refused(
            f"inbox entry #{index} is a cancel request sealed for another run",
            "inbox_seal",
            index=index,
        )
    return RecordReport(
        index,
        "sealed",
        "cancel",
        clean(request.request_id, 60),
        clean(request.by, 100),
        request.requested_at_ms,
    )


_EVIDENCE: tuple[tuple[str, type[ApprovalEvidence | ReviewDecision | RebaselineDecision]], ...] = (
    ("approval", ApprovalEvidence),
    ("review", ReviewDecision),
    ("rebaseline", RebaselineDecision),
)


def _evidence(
    run_id: str,
    index: int,
    raw: bytes,
    approvers: TrustRoots | None,
    reviewers: TrustRoots | None,
) -> RecordReport:
    for kind, model in _EVIDENCE:
        try:
            evidence = model.model_validate_json(raw)
        except ValidationError:
            continue
        if isinstance(evidence, ApprovalEvidence):
            signer, roots = evidence.approver_id, approvers
        else:
            signer, roots = evidence.reviewer_id, reviewers
        shown = RecordReport(index, "", kind, clean(evidence.claims.nonce, 80), clean(signer, 100))
        if evidence.claims.run_id != run_id:
            return _with(shown, "forged", "forged: its claims name another run")
        if roots is None:
            role = "approver" if kind == "approval" else "reviewer"
            return _with(shown, "unchecked", f"unchecked: no {role} trust roots given")
        try:
            if isinstance(evidence, ApprovalEvidence):
                roots.verify_approval(evidence, allow_revoked=True)
            elif isinstance(evidence, ReviewDecision):
                roots.verify_review(evidence, allow_revoked=True)
            else:
                roots.verify_rebaseline(evidence, allow_revoked=True)
        except EvidenceError as exc:
            if exc.reason == "unknown_signer":
                return _with(shown, "unchecked", f"unchecked: {exc.message}")
            return _with(shown, "forged", f"forged: {exc.message}")
        return _with(shown, "signed", "")
    return RecordReport(
        index,
        "unsigned",
        "unknown",
        clean(raw.decode("utf-8", "replace"), 80),
        note="unsigned: not evidence or a request",
    )


def _with(record: RecordReport, status: str, note: str) -> RecordReport:
    return replace(record, status=status, note=clean(note, 300))


def judge_inbox(
    keyring: KeyRing,
    run_id: str,
    stored: list[str],
    *,
    approvers: TrustRoots | None = None,
    reviewers: TrustRoots | None = None,
) -> PartReport:
    """Each inbox entry (base64 of the stored bytes): cancel requests by their seal,
    approvals and reviewer decisions by their signature when trust roots are given.

    Raises IntegrityError (``check="inbox_seal"`` for a sealed request whose seal does not
    verify or that was sealed for another run, ``"schema"`` for an entry not base64).
    """
    records = []
    for index, text in enumerate(stored):
        try:
            raw = base64.b64decode(text, validate=True)
        except (ValueError, TypeError):
            raise _refused("an inbox entry is not base64", "schema") from None
        if _is_envelope(raw):
            records.append(_control(keyring, run_id, index, raw))
        else:
            records.append(_evidence(run_id, index, raw, approvers, reviewers))
    return _records_part(
        "inbox",
        records,
        "sealed (cancel requests: HMAC, key ring) or signed (approvals, decisions: Ed25519, "
        "trust roots)",
    )
