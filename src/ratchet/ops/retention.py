"""Retention: export a run as one verifiable file, verify it offline, purge finished runs.

A finished run keeps its checkpoint, archive, document, history and records in Redis
until it is purged. Nothing here ever removes a run that is not finished or whose
evidence is not all consumed, and nothing lets a purged run's ids be reused.

Export file (``ratchet export RUN``): one HMAC envelope under the fleet's key ring, in its
own domain (``ratchet/export/v1``), over canonical JSON::

    {"format": 2, "run_id", "exported_at_ms" (store clock), "generation",
     "document", "checkpoint", "archive": [...]   (the stored bytes, base64: each keeps
                                                   its own MAC),
     "history": [...], "incidents": [...]   (the stored entries, exactly as Redis holds
                                             them: ``at_ms|record``),
     "consumed_nonces": [...],
     "inbox": [...]  (base64: evidence and requests left for the run)}

``ratchet verify FILE`` (:func:`verify_export`) needs only the key ring, no store: the
envelope, then the document and the checkpoint with its archive exactly as a worker's
restore checks them (MACs, schema, the document bound by the checkpoint, invariants),
that the checkpoint is the exported generation and the consumed nonces are the
checkpoint's. Then it says, part by part, what it vouches for
(:mod:`ratchet.ops.vouching`): those signed parts whole; history, incidents and inbox
record by record, each only by its own seal or signature (a sealed incident or cancel
request, an approval or decision under the trust roots given), never by the export's
envelope, which only shows the file was not changed since it was made. A record pushed
into Redis by hand reads as unsigned; one whose seal does not verify refuses the export.
Format 1 files (made before records were sealed) still verify, their records unsigned.
Neither export nor verify writes to the store.

Purge (``ratchet purge --finished-before DURATION``, and the workers on their own when
``RATCHET_RETENTION_S`` is set): candidates come from the terminal phases' indexes, scored
by when the run entered the phase. Each is verified first (a run that does not verify is
kept, with the reason); a run with a live lease or an unconsumed approval or decision in
its inbox is kept; with an export folder the export is written (and read back and
verified) before anything is removed; then one script removes the run if it is still
exactly what was verified, leaving a tombstone (:mod:`ratchet.leasing.retention`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ratchet.errors import (
    CheckpointError,
    ConfigurationError,
    ContractError,
    IntegrityError,
    RatchetError,
    StoreProtocolError,
)
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import check_document_binding, open_document
from ratchet.leasing.keyspace import run_keys
from ratchet.ops.operations import RunView, inspect_run
from ratchet.ops.vouching import (
    PartReport,
    judge_history,
    judge_inbox,
    judge_incidents,
    signed_part,
)
from ratchet.runtime import (
    ApprovalEvidence,
    KeyRing,
    RebaselineDecision,
    ReviewDecision,
    TrustRoots,
)
from ratchet.runtime.canonical import Domain, canonical_json, strict_json_loads
from ratchet.runtime.restore import open_checkpoint
from ratchet.runtime.signing import open_envelope, seal_envelope
from ratchet.runtime.state import TERMINAL_PHASES, RunState, check_invariants

__all__ = [
    "ExportSummary",
    "PurgeReport",
    "RetentionLoop",
    "export_run",
    "purge_finished",
    "start_retention",
    "verify_export",
    "write_export",
]

log = logging.getLogger("ratchet.ops.retention")

EXPORT_FORMAT = 2
_FORMATS = (1, 2)  # format 1: incidents as read (objects), nothing sealed per record
MAX_EXPORT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What a verified export holds, and what it vouches for, part by part (``parts``:
    document, checkpoint, archive, consumed nonces, history, incidents, inbox)."""

    run_id: str
    phase: str
    generation: int
    task_id: str
    executed: int
    trace_events: int
    exported_at_ms: int
    parts: tuple[PartReport, ...] = ()
    export_format: int = EXPORT_FORMAT

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "phase": self.phase,
            "generation": self.generation,
            "task_id": self.task_id,
            "executed_writes": self.executed,
            "trace_events": self.trace_events,
            "exported_at_ms": self.exported_at_ms,
            "format": self.export_format,
            # The file's own seal and every signed part verified; see "parts" for what
            # that vouches for.
            "verified": True,
            "vouched_for": [p.name for p in self.parts if p.vouched],
            "not_vouched_for": [p.name for p in self.parts if not p.vouched],
            "parts": {p.name: p.as_dict() for p in self.parts},
        }


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def export_run(fleet: Fleet, run_id: str, *, view: RunView | None = None) -> bytes:
    """The export file's bytes for ``run_id`` (verified first: a run that does not verify
    is not exported). Raises what :func:`~ratchet.ops.inspect_run` raises."""
    view = view or inspect_run(fleet, run_id)
    snap = view.snapshot
    if snap.checkpoint is None or snap.scenario is None:
        raise IntegrityError("the run has no checkpoint or document", run_id=run_id)
    keys = run_keys(run_id)
    client = fleet.store.client
    # Records exactly as Redis holds them (read only): verify judges each by its own seal.
    history = [_text(h) for h in client.lrange(keys.history, 0, -1)]
    incidents = [_text(i) for i in client.lrange(keys.incidents, 0, -1)]
    body = {
        "format": EXPORT_FORMAT,
        "run_id": run_id,
        "exported_at_ms": fleet.store.server_time_ms(),
        "generation": view.generation,
        "document": _b64(snap.scenario),
        "checkpoint": _b64(snap.checkpoint),
        "archive": [_b64(segment) for segment in snap.archive],
        "history": history,
        "incidents": incidents,
        "consumed_nonces": list(view.state.consumed_nonces),
        "inbox": [_b64(raw) for raw in fleet.store.records.inbox(run_id, limit=1000)],
    }
    return seal_envelope(fleet.keyring, canonical_json(body), domain=Domain.EXPORT)


def write_export(
    fleet: Fleet, run_id: str, path: Path, *, view: RunView | None = None
) -> ExportSummary:
    """Write ``run_id``'s export to ``path`` (owner-only, atomically: a temporary file in
    the same folder, then a rename), read it back and verify it. Returns its summary.

    Raises what :func:`export_run` and :func:`verify_export` raise, ConfigurationError for a
    folder that cannot be written.
    """
    blob = export_run(fleet, run_id, view=view)
    roots = {"approvers": fleet.approvers, "reviewers": fleet.reviewers}
    summary = verify_export(fleet.keyring, blob, **roots)  # never write what would not verify
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigurationError(
            f"cannot write the export {path}: {exc.strerror or exc}", field="export"
        ) from None
    if verify_export(fleet.keyring, path.read_bytes(), **roots) != summary:
        raise IntegrityError("the export read back differs from what was written", run_id=run_id)
    return summary


def _refused(message: str, **context: Any) -> IntegrityError:
    return IntegrityError(f"export refused: {message}", reason="export", **context)


def verify_export(
    keyring: KeyRing,
    blob: bytes,
    *,
    approvers: TrustRoots | None = None,
    reviewers: TrustRoots | None = None,
) -> ExportSummary:
    """Verify an export file offline (see the module docstring). Returns its summary, with
    what it vouches for part by part; ``approvers`` and ``reviewers`` check the evidence
    in the inbox (without them it reads as unchecked).

    Raises:
        IntegrityError: ``reason="export"`` (or the document's / checkpoint's own
            refusal), naming the failed check (``incident_seal``, ``inbox_seal``: a
            record whose seal does not verify).
    """
    if len(blob) > MAX_EXPORT_BYTES:
        raise _refused("the file is larger than any export", check="size")
    try:
        body = open_envelope(keyring, blob, domain=Domain.EXPORT)
    except CheckpointError as exc:
        raise _refused(
            f"it does not verify ({exc.reason or 'malformed'})",
            check=exc.reason or "malformed",
        ) from None
    try:
        data = strict_json_loads(body)
    except ContractError:
        raise _refused("its signed body is not strict JSON", check="schema") from None
    want = {
        "format",
        "run_id",
        "exported_at_ms",
        "generation",
        "document",
        "checkpoint",
        "archive",
        "history",
        "incidents",
        "consumed_nonces",
        "inbox",
    }
    if not isinstance(data, dict) or set(data) != want or data["format"] not in _FORMATS:
        raise _refused("its signed body has the wrong fields or format", check="schema")
    records = (data["history"], data["incidents"], data["consumed_nonces"], data["inbox"])
    if not all(isinstance(r, list) for r in records) or not all(
        isinstance(e, str) for e in (*data["history"], *data["consumed_nonces"], *data["inbox"])
    ):
        raise _refused("its records are not lists of text", check="schema")
    try:
        run_id = str(data["run_id"])
        document_raw = base64.b64decode(data["document"], validate=True)
        checkpoint_raw = base64.b64decode(data["checkpoint"], validate=True)
        archive = tuple(base64.b64decode(s, validate=True) for s in data["archive"])
    except (ValueError, TypeError):
        raise _refused("a stored blob is not base64", check="schema") from None
    checkpoint = checkpoint_raw  # the envelope as a restore reads it (decoded)
    document = open_document(keyring, run_id, document_raw)
    payload = open_checkpoint(checkpoint, keyring=keyring, archive=archive)
    check_document_binding(payload.state, document)
    state: RunState = payload.state
    if state.run_id != run_id or payload.generation != data["generation"]:
        raise _refused("the checkpoint is another run's or another generation's", check="binding")
    if payload.scenario_fingerprint != document.scenario.fingerprint:
        raise _refused("the checkpoint was made under another scenario", check="scenario")
    try:
        check_invariants(state, document.scenario)
    except RatchetError as exc:
        raise _refused(
            f"the checkpoint's state is invalid: {exc.message}", check="invariant"
        ) from None
    if sorted(data["consumed_nonces"]) != sorted(state.consumed_nonces):
        raise _refused("the consumed nonces are not the checkpoint's", check="nonces")
    # Format 1 held incidents as read (objects): judged the same way (none has a seal).
    parts = (
        signed_part("document", "HMAC under the key ring, bound to the run", 1),
        signed_part("checkpoint", f"HMAC under the key ring, generation {payload.generation}", 1),
        signed_part("archive", "its hash chain, signed in the checkpoint", len(archive)),
        signed_part("consumed_nonces", "the signed checkpoint", len(state.consumed_nonces)),
        judge_history(data["history"]),
        judge_incidents(keyring, run_id, data["incidents"]),
        judge_inbox(keyring, run_id, data["inbox"], approvers=approvers, reviewers=reviewers),
    )
    return ExportSummary(
        run_id,
        state.phase.value,
        payload.generation,
        state.task_id,
        len(state.executed),
        len(state.trace),
        int(data["exported_at_ms"]),
        parts,
        int(data["format"]),
    )


# --- purge -------------------------------------------------------------------------------


@dataclass
class PurgeReport:
    """What a purge did: runs removed, exports written, runs kept and why."""

    cutoff_ms: int
    purged: list[str] = field(default_factory=list)
    exported: dict[str, str] = field(default_factory=dict)  # run -> export file
    kept: dict[str, str] = field(default_factory=dict)  # run -> why it was kept
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "cutoff_ms": self.cutoff_ms,
            "purged": self.purged,
            "exported": self.exported,
            "kept": self.kept,
            "dry_run": self.dry_run,
        }


def _unconsumed(raw: bytes, state: RunState) -> str | None:
    """Why an inbox entry is evidence the run never consumed (None: it was, or it is not
    evidence). A finished run's cancel requests are moot, not evidence."""
    for model in (ApprovalEvidence, ReviewDecision, RebaselineDecision):
        try:
            evidence = model.model_validate_json(raw)
        except ValidationError:
            continue
        nonce = evidence.claims.nonce
        return None if nonce in state.consumed_nonces else f"unconsumed evidence {nonce}"
    return None


def purge_finished(
    fleet: Fleet,
    *,
    older_than_ms: int,
    export_dir: Path | None = None,
    limit: int = 500,
    dry_run: bool = False,
) -> PurgeReport:
    """Purge up to ``limit`` runs that finished (completed, failed, cancelled) more than
    ``older_than_ms`` ago by the store's clock, exporting each first into ``export_dir``
    when one is given. See the module docstring for what keeps a run.

    Raises ContractError (a negative age or limit), StoreUnavailableError.
    """
    if older_than_ms < 0 or limit < 1:
        raise ContractError("the age must be >= 0 and the limit >= 1", field="finished_before")
    cutoff = fleet.store.server_time_ms() - older_than_ms
    report = PurgeReport(cutoff, dry_run=dry_run)
    candidates: list[str] = []
    for phase in sorted(TERMINAL_PHASES):
        candidates += fleet.store.entered_before(phase.value, cutoff, limit=limit)
    for run_id in sorted(set(candidates))[:limit]:
        why = _purge_one(fleet, run_id, export_dir=export_dir, dry_run=dry_run, report=report)
        if why is not None:
            report.kept[run_id] = why
    if report.purged:
        log.info(
            "purged finished runs", extra={"purged": len(report.purged), "kept": len(report.kept)}
        )
    return report


def _purge_one(
    fleet: Fleet, run_id: str, *, export_dir: Path | None, dry_run: bool, report: PurgeReport
) -> str | None:
    try:
        view = inspect_run(fleet, run_id)
    except RatchetError as exc:
        return f"does not verify: {exc.message}"[:300]
    state, snap = view.state, view.snapshot
    if state.phase not in TERMINAL_PHASES:
        return f"not finished ({state.phase.value})"
    if snap.lease_live:
        return f"held by {snap.owner}"
    for raw in fleet.store.records.inbox(run_id, limit=1000):
        why = _unconsumed(raw, state)
        if why is not None:
            return why
    if dry_run:
        report.purged.append(run_id)
        return None
    name = ""
    if export_dir is not None:
        path = export_dir / f"{run_id.replace('/', '_')}.ratchet-export"
        try:
            write_export(fleet, run_id, path, view=view)
        except RatchetError as exc:
            return f"export failed: {exc.message}"[:300]
        report.exported[run_id] = str(path)
        name = path.name
    digest = hashlib.sha256(snap.checkpoint or b"").hexdigest()
    outcome = fleet.store.purge_run(
        run_id,
        generation=snap.generation,
        state_version=snap.state_version,
        phase=state.phase.value,
        checkpoint_digest=digest,
        export=name,
    )
    if outcome != "purged":
        return {
            "gone": "already gone",
            "moved": "changed since it was verified",
            "held": "a worker took its lease",
        }.get(outcome, outcome)
    report.purged.append(run_id)
    return None


class RetentionLoop:
    """A worker's daemon thread applying ``retention_s`` on its own: every ``every_s`` it
    purges (and, with ``retention_export_dir``, first exports) up to ``limit`` runs that
    finished longer ago than ``older_than_ms``. Several workers may run one each: a purge
    of a run another worker purged first is a no-op (``gone``). A store that refuses the
    purge script (the least-privilege worker ACL has no ``DEL``) is reported once and
    the loop stops; run ``ratchet purge`` as the operator instead."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        older_than_ms: int,
        every_s: float,
        export_dir: Path | None = None,
        limit: int = 200,
    ) -> None:
        self._fleet = fleet
        self._older_than_ms = older_than_ms
        self._every = every_s
        self._export_dir = export_dir
        self._limit = limit
        self._stop = threading.Event()
        self.purged = 0
        self._thread = threading.Thread(target=self._loop, name="ratchet-retention", daemon=True)

    def start(self) -> RetentionLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(2 * self._every, 1.0))

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                report = purge_finished(
                    self._fleet,
                    older_than_ms=self._older_than_ms,
                    export_dir=self._export_dir,
                    limit=self._limit,
                )
            except StoreProtocolError as exc:
                log.error(
                    "retention stopped: the store refused the purge", extra={"reason": exc.message}
                )
                return
            except RatchetError as exc:
                log.warning("retention pass failed", extra={"error": type(exc).__name__})
                continue
            self.purged += len(report.purged)


def start_retention(fleet: Fleet) -> RetentionLoop | None:
    """Start this worker's retention loop if ``retention_s`` is set (None otherwise). It
    runs every tenth of the retention period, at most once a minute."""
    settings = fleet.settings
    if settings.retention_s is None:
        return None
    every = min(60.0, settings.retention_s / 10)
    return RetentionLoop(
        fleet,
        older_than_ms=settings.retention_s * 1000,
        every_s=every,
        export_dir=settings.retention_export_dir,
    ).start()
