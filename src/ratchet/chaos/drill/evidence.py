"""Read what a drill left behind: failpoint hits, worker events, adapter records, Redis.

Everything here reads; nothing decides. The checker (:mod:`ratchet.chaos.drill.checker`)
turns these facts into invariant verdicts.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.chaos.drill.humanchecks import HumanFacts, gather_humans
from ratchet.chaos.drill.plan import DrillRecord
from ratchet.chaos.drill.services import NOTE
from ratchet.chaos.drill.skew import unskew
from ratchet.errors import AdapterError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.leasing import run_keys
from ratchet.ops import inspect_run
from ratchet.runtime import TraceOutcome

__all__ = ["EVIDENCE_BUSY_S", "AdapterRecords", "Evidence", "RunFacts", "gather", "read_workspace"]


@dataclass
class AdapterRecords:
    """One run's effects as its adapters recorded them."""

    file_effects: dict[str, int] = field(default_factory=dict)  # intent digest -> writes
    order_effects: dict[str, int] = field(default_factory=dict)  # order body -> orders
    receipt_keys: set[str] = field(default_factory=set)  # keys with a committed effect
    lease_inversions: int = 0  # a committed write under a lower lease than an earlier one
    refused_workspace: int = 0
    refused_orders: int = 0
    unresolved: int = 0  # requests or intents still in flight
    # Orders another client placed in the run's tenant (the reviews fault), by key: not
    # the run's effects.
    foreign_orders: dict[str, int] = field(default_factory=dict)
    own_order_keys: dict[str, int] = field(default_factory=dict)  # the run's orders, by key
    journal_check: str = ""  # the workspace journal's PRAGMA quick_check ("ok")
    note: str | None = None  # the workspace's note file as the drill left it

    @property
    def effects(self) -> int:
        return sum(self.file_effects.values()) + sum(self.order_effects.values())

    @property
    def duplicates(self) -> int:
        return sum(
            max(0, n - 1) for n in (*self.file_effects.values(), *self.order_effects.values())
        )


@dataclass
class RunFacts:
    run_id: str
    index: int
    status: str
    phase: str
    generation: int | None
    history: list[tuple[int, int, str]]  # (generation, lease_version, digest), newest first
    executed_keys: set[str]
    review_reason: str | None
    incidents: list[dict[str, Any]]
    adapters: AdapterRecords
    cancel_request: str | None = None  # the request id a signed ``cancelled`` event names
    # That event says the run ended on an environment its checkpoint does not explain.
    cancelled_unreconciled: bool = False
    consumed_nonces: list[str] = field(default_factory=list)
    quarantined_keys: list[str] = field(default_factory=list)
    # Review cases the run closed: case id, reason, decision nonce and verdict.
    closed_reviews: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Evidence:
    fired: list[dict[str, Any]]
    events: dict[str, list[dict[str, Any]]]
    runs: dict[str, RunFacts]
    humans: HumanFacts = field(default_factory=HumanFacts)  # approvals, nonces, commit times


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill mid-write is not evidence
    return out


#: How long the checker waits for a workspace journal's lock: every worker has stopped by
#: then, so a lock still held is itself evidence (reported, never waited out).
EVIDENCE_BUSY_S = 5.0


def _read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)


def read_workspace(root: Path, records: AdapterRecords) -> str | None:
    """Read one run's workspace journal into ``records``. Returns why the adapter could
    not open it (its reads then come from the file as it is, and its check says so), or
    None."""
    # Opening the adapter resolves any write a killed worker left half-done (under the
    # workspace lock), so the journal read next is final.
    failed: str | None = None
    try:
        with WorkspaceAdapter(root, [NOTE], busy_timeout_s=EVIDENCE_BUSY_S) as adapter:
            records.refused_workspace = adapter.refused_stale
    except AdapterError as exc:
        failed = f"{exc.message} ({exc.context.get('error')})"
    db = _read_only(root / ".ratchet" / "journal.sqlite3")
    try:
        rows = db.execute(
            "SELECT idempotency_key, intent_digest, lease_version, status FROM writes ORDER BY seq"
        ).fetchall()
        records.journal_check = "; ".join(str(r[0]) for r in db.execute("PRAGMA quick_check"))
    finally:
        db.close()
    if failed is not None:
        records.journal_check = f"not recovered: {failed}; {records.journal_check}"
    try:
        records.note = (root / NOTE).read_text()
    except (OSError, UnicodeDecodeError):
        records.note = None
    highest = 0
    for key, intent, lease_version, status in rows:
        if status == "intent":
            records.unresolved += 1
        if status != "committed":
            continue
        records.file_effects[intent] = records.file_effects.get(intent, 0) + 1
        records.receipt_keys.add(key)
        if int(lease_version) < highest:
            records.lease_inversions += 1
        highest = max(highest, int(lease_version))
    return failed


def _orders(db_path: Path, records: AdapterRecords, foreign: frozenset[str]) -> None:
    if not db_path.exists():
        return
    db = _read_only(db_path)
    try:
        for key, body in db.execute("SELECT idempotency_key, body FROM orders"):
            if key in foreign:
                records.foreign_orders[key] = records.foreign_orders.get(key, 0) + 1
                continue
            records.order_effects[body] = records.order_effects.get(body, 0) + 1
            records.own_order_keys[key] = records.own_order_keys.get(key, 0) + 1
            records.receipt_keys.add(key)
        row = db.execute("SELECT value FROM meta WHERE key = 'refused_stale'").fetchone()
        records.refused_orders = int(row[0]) if row else 0
        records.unresolved += int(
            db.execute("SELECT count(*) FROM requests WHERE status = 'in_flight'").fetchone()[0]
        )
    finally:
        db.close()


def _history(fleet: Fleet, run_id: str) -> list[tuple[int, int, str]]:
    out = []
    for raw in fleet.store.client.lrange(run_keys(run_id).history, 0, -1):
        parts = raw.decode("utf-8", "replace").split("|")
        if len(parts) >= 6 and parts[0].isdigit() and parts[2].isdigit():
            out.append((int(parts[0]), int(parts[2]), parts[5]))
    return out


def _raw_generation(fleet: Fleet, run_id: str) -> int | None:
    raw = fleet.store.client.hget(run_keys(run_id).state, "generation")
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw or "")
    return int(text) if text.isdigit() else None


def _raw_incidents(fleet: Fleet, run_id: str) -> list[dict[str, Any]]:
    try:
        return fleet.store.records.incidents(run_id)
    except RatchetError:
        return []


def gather(record: DrillRecord, fleet: Fleet) -> Evidence:
    """Read every record the drill left. Raises StoreUnavailableError if Redis is down."""
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    # A worker the drill started with a skewed clock logged skewed times: put them back on
    # the drill's clock, so every check that reads a time reads one clock.
    skews = {int(p): float(s) for p, s in (record.humans or {}).get("skews", {}).items()}
    for path in sorted(record.events_dir.glob("events-*.jsonl")):
        for event in _jsonl(path):
            _unskew(event, skews)
            events[str(event.get("kind"))].append(event)
    runs: dict[str, RunFacts] = {}
    foreign = frozenset((record.reviews or {}).get("foreign_keys", []))
    for run_id, index in record.runs.items():
        adapters = AdapterRecords()
        unopened = read_workspace(record.folder / "workspaces" / f"ws-{index}", adapters)
        if unopened is not None:
            # Kept as evidence, never a crash of the checker: the run's checks see it.
            record.errors.append(f"workspace of {run_id} not opened: {unopened}")
        _orders(record.folder / "orders" / f"t{index}.sqlite3", adapters, foreign)
        status, phase = record.final.get(run_id, ("unreadable", "unknown"))
        generation: int | None = None
        executed: set[str] = set()
        reason: str | None = None
        incidents: list[dict[str, Any]] = []
        cancel_request: str | None = None
        unreconciled = False
        reviews: dict[str, Any] = {}
        try:
            view = inspect_run(fleet, run_id)
            generation = view.generation
            executed = {e.idempotency_key for e in view.state.executed}
            if view.state.review is not None:
                reason = str(view.state.review.reason)
            incidents = view.incidents
            reviews = {
                "consumed_nonces": list(view.state.consumed_nonces),
                "quarantined_keys": list(view.state.quarantined_keys),
                "closed_reviews": [
                    {
                        "case_id": c.case_id,
                        "reason": str(c.reason),
                        "nonce": c.decision.claims.nonce if c.decision else None,
                        "verdict": str(c.decision.claims.verdict) if c.decision else None,
                    }
                    for c in view.state.closed_reviews
                ],
            }
            cancelled = next(
                (e for e in view.state.trace if e.outcome is TraceOutcome.CANCELLED), None
            )
            if cancelled is not None:
                cancel_request = str(cancelled.detail.get("request_id"))
                unreconciled = "env_version_now" in cancelled.detail
        except RatchetError:
            # A run whose record was corrupted cannot be inspected: read what its state
            # hash and incident list hold directly (the checker needs both).
            generation, incidents = _raw_generation(fleet, run_id), _raw_incidents(fleet, run_id)
        runs[run_id] = RunFacts(
            run_id,
            index,
            status,
            phase,
            generation,
            _history(fleet, run_id),
            executed,
            reason,
            incidents,
            adapters,
            cancel_request,
            unreconciled,
            **reviews,
        )
    fired = _jsonl(record.fired_log)
    for entry in fired:
        _unskew(entry, skews)
    return Evidence(fired, dict(events), runs, gather_humans(record, fleet))


def _unskew(entry: dict[str, Any], skews: dict[int, float]) -> None:
    pid, at = entry.get("pid"), entry.get("at")
    if isinstance(pid, int) and pid in skews and isinstance(at, int | float):
        entry["at"] = unskew(float(at), skews[pid])
