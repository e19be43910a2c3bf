"""The invariants of the workspace faults (:mod:`ratchet.chaos.drill.workspacefaults`).

Judged by identity: the jobs that met a fault are the ``job_end`` events (run, lease
version, pid) that ended, while it was held (and a grace after), ``retry_later`` with the
workspace's own detail, or as a ``job_error`` or ``poisoned`` on a storage failure; the
runs judged are the locked run, or every run live when the disk filled and every run a
job of which met it. For each: no job of it ended the second way (the failure must be the
retryable one), no effect doubled, no intent left unresolved in its journal, its journal
passes SQLite's ``quick_check``, a completed run has exactly its two file writes (each
recorded by its receipts) and its note as the plan wrote it last, and the run settled.
``unknown`` when no job met the fault (or it was skipped: not root, for the disk).
"""

from __future__ import annotations

from typing import Any

from ratchet.chaos.drill.evidence import Evidence, RunFacts
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.plan import DrillRecord
from ratchet.chaos.drill.services import expected_note
from ratchet.chaos.drill.workspacefaults import (
    failed_on_storage,
    grace_s,
    met_the_fault,
    retried,
)

__all__ = ["WORKSPACE_INVARIANTS", "workspace_fired", "workspace_invariants", "workspace_summary"]

#: The invariant each workspace fault is judged by.
WORKSPACE_INVARIANTS = {
    "sqlite-busy": "busy_journal_retried",
    "workspace-full": "full_workspace_no_effect_lost",
}
_UNSETTLED = ("active", "unreadable")


def _faults(record: DrillRecord, kind: str) -> list[dict[str, Any]]:
    return [f for f in record.workspace_faults if f.get("kind") == kind and "at" in f]


def _window(fault: dict[str, Any]) -> tuple[float, float]:
    start = float(fault["at"])
    return start, float(fault.get("ended_at", start + float(fault["hold_s"]))) + grace_s()


def _ends(fault: dict[str, Any], evidence: Evidence) -> list[dict[str, Any]]:
    """The jobs that ended while ``fault`` was held (and a grace after), on the drill's
    clock; the locked run's only, for a locked journal."""
    since, until = _window(fault)
    return [
        e
        for e in evidence.events.get("job_end", [])
        if isinstance(e.get("at"), int | float)
        and since <= float(e["at"]) <= until
        and (fault["kind"] == "workspace-full" or e.get("run_id") == fault["run_id"])
    ]


def jobs_met(fault: dict[str, Any], evidence: Evidence) -> list[dict[str, Any]]:
    """The jobs that met ``fault``, retried or failed on it."""
    return [e for e in _ends(fault, evidence) if met_the_fault(e)]


def workspace_fired(record: DrillRecord, evidence: Evidence) -> dict[str, int]:
    """How often each workspace fault fired with a job meeting it (``every_fault_fired``)."""
    return {
        kind: sum(1 for f in _faults(record, kind) if jobs_met(f, evidence))
        for kind in WORKSPACE_INVARIANTS
    }


def _run_problems(facts: RunFacts, record: DrillRecord) -> list[str]:
    problems = []
    a = facts.adapters
    if a.duplicates:
        problems.append(f"{facts.run_id}: {a.duplicates} doubled effects")
    if a.unresolved:
        problems.append(f"{facts.run_id}: {a.unresolved} writes unresolved")
    if a.journal_check != "ok":
        problems.append(f"{facts.run_id}: journal check {a.journal_check!r}")
    if facts.phase == "completed":
        if sum(a.file_effects.values()) != 2:
            problems.append(f"{facts.run_id}: completed with {sum(a.file_effects.values())} writes")
        if a.note != expected_note(facts.index):
            problems.append(f"{facts.run_id}: completed with its note {a.note!r}")
        if not a.receipt_keys <= facts.executed_keys:
            problems.append(f"{facts.run_id}: an effect its receipts do not record")
    if facts.status in _UNSETTLED and facts.run_id not in record.corrupted:
        problems.append(f"{facts.run_id}: unsettled ({facts.status})")
    return problems


def _judge(record: DrillRecord, evidence: Evidence, kind: str) -> Invariant:
    name = WORKSPACE_INVARIANTS[kind]
    faults = _faults(record, kind)
    judged, met, problems = 0, 0, []
    runs: set[str] = set()
    for fault in faults:
        mine = jobs_met(fault, evidence)
        if not mine:
            continue
        judged += 1
        met += sum(1 for e in mine if retried(e))
        watched = {str(e["run_id"]) for e in mine} | {str(fault["run_id"])}
        if kind == "workspace-full":
            watched |= {str(r) for r in fault.get("live_runs", [])}
        runs |= watched
        for e in _ends(fault, evidence):
            if str(e.get("run_id")) in watched and failed_on_storage(e):
                problems.append(
                    f"{e['run_id']}: job under lease {e.get('lease_version')} ended "
                    f"{e['outcome']} on storage: {str(e.get('detail'))[:80]}"
                )
    for run_id in sorted(runs):
        facts = evidence.runs.get(run_id)
        if facts is None:
            problems.append(f"{run_id}: no facts")
            continue
        problems += _run_problems(facts, record)
    skipped = record.workspace_skipped.get(kind)
    return Invariant(
        name,
        "fail" if problems else ("pass" if judged else "unknown"),
        f"{len(faults)} injected, {judged} met by a job ({met} jobs ended retry_later), "
        f"{len(runs)} runs judged; {len(problems)} problems"
        + (f": {'; '.join(problems[:4])}" if problems else "")
        + (f"; skipped: {skipped}" if skipped else ""),
        len(faults),
    )


def workspace_invariants(record: DrillRecord, evidence: Evidence) -> list[Invariant]:
    """The invariant of every workspace fault the drill was asked for."""
    return [
        _judge(record, evidence, kind)
        for kind in WORKSPACE_INVARIANTS
        if kind in record.options.faults
    ]


_SUMMARY = ("kind", "at", "ended_at", "run_id", "lease_version", "pid", "hold_s", "live_runs")


def workspace_summary(record: DrillRecord, evidence: Evidence) -> list[dict[str, Any]]:
    """The workspace faults for the report: what each held, when, and the jobs it met."""
    return [
        {**{k: f[k] for k in _SUMMARY if k in f}, "jobs_met": len(jobs_met(f, evidence))}
        for f in record.workspace_faults
        if "at" in f
    ]
