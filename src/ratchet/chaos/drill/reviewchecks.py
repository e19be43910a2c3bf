"""The invariant of the reviews fault (:mod:`ratchet.chaos.drill.reviewers`).

``reviews_decided_once`` judges each run that met a planted conflict by identity: the
key another client used, the nonces the drill signed (stale, fresh, replayed) and what
the run's signed checkpoint consumed and quarantined. ``unknown`` when no run consumed a
decision (none reached its order, or every one was cancelled, rewound or corrupted
first).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ratchet.chaos.drill.evidence import Evidence, RunFacts
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.plan import DrillRecord
from ratchet.chaos.drill.services import order_body

__all__ = ["planted_review_waiting", "review_invariants", "reviews_fired", "reviews_summary"]


def _decisions(record: DrillRecord, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [
        d
        for d in (record.reviews or {}).get("decisions", [])
        if d.get("run") == run_id and d.get("kind") == kind and d.get("nonce")
    ]


def _consumed_fresh(record: DrillRecord, facts: RunFacts) -> list[dict[str, Any]]:
    return [
        d for d in _decisions(record, facts.run_id, "fresh") if d["nonce"] in facts.consumed_nonces
    ]


def planted_review_waiting(record: DrillRecord, facts: RunFacts) -> bool:
    """A run that met a conflict the drill planted and still waits for its reviewer: the
    conflict is expected, and the case is its evidence."""
    return (
        facts.run_id in (record.reviews or {}).get("runs", {})
        and facts.phase == "needs_review"
        and facts.review_reason == "intent_conflict"
    )


def reviews_fired(record: DrillRecord, evidence: Evidence) -> dict[str, int]:
    """Runs that consumed a decision the drill signed for their planted conflict."""
    runs = (record.reviews or {}).get("runs", {})
    return {
        "reviews": sum(
            1
            for run_id in runs
            if run_id in evidence.runs and _consumed_fresh(record, evidence.runs[run_id])
        )
    }


def _problems(record: DrillRecord, facts: RunFacts, info: dict[str, Any]) -> list[str]:
    run_id, key = facts.run_id, str(info["key"])
    problems = []
    consumed = facts.consumed_nonces
    if len(consumed) != len(set(consumed)):
        problems.append(f"{run_id}: a nonce consumed twice")
    decided = {c.get("nonce") for c in facts.closed_reviews}
    for stale in _decisions(record, run_id, "stale"):
        if stale["nonce"] in consumed or stale["nonce"] in decided:
            problems.append(f"{run_id}: the decision signed before the environment moved applied")
    for replay in _decisions(record, run_id, "replay"):
        if replay.get("posted") == "checked":
            problems.append(f"{run_id}: the checked path accepted a consumed decision again")
    if facts.adapters.foreign_orders.get(key, 0) != 1:
        problems.append(f"{run_id}: the planted order under its key is not there once")
    fresh = _consumed_fresh(record, facts)
    if not fresh:
        if facts.phase == "completed":
            problems.append(f"{run_id}: completed without a reviewer's decision")
        return problems
    verdict = fresh[-1]["verdict"]
    own = facts.adapters.own_order_keys
    if verdict == "replan":
        if key not in facts.quarantined_keys:
            problems.append(f"{run_id}: replanned without quarantining the conflicting key")
        if facts.phase == "completed":
            if facts.adapters.order_effects.get(order_body(facts.index), 0) != 1 or len(own) != 1:
                problems.append(f"{run_id}: completed after a replan without its one order")
            if key in own:
                problems.append(f"{run_id}: an order of its own under the quarantined key")
            if not facts.adapters.receipt_keys <= facts.executed_keys:
                problems.append(f"{run_id}: an effect its receipts do not record")
    else:
        if facts.phase != "failed":
            problems.append(f"{run_id}: aborted by its reviewer but {facts.phase}")
        if own:
            problems.append(f"{run_id}: aborted, yet {sum(own.values())} orders of its own")
    # The drill decided once it saw the stale decision refused; a decision made only after
    # its patience ran out may have been read first (the inbox holds both), leaving the
    # stale one unread: then only "never applied" (above) can be asked of it.
    if fresh[-1].get("stale_refusal_seen") and not any(
        i.get("kind") == "evidence_refused" and i.get("reason") == "environment_changed"
        for i in facts.incidents
    ):
        problems.append(f"{run_id}: no refusal of the decision signed before the move")
    return problems


def review_invariants(
    record: DrillRecord, evidence: Evidence, rewound: Collection[str]
) -> list[Invariant]:
    """``reviews_decided_once``, when the drill was asked for ``reviews``.

    For each run that met a planted conflict (not corrupted, not rewound by the rollback):
    no decision signed before its environment moved applied; no nonce consumed twice; the
    replayed decision refused by the checked path; the planted order there once; and once
    it consumed the drill's decision: a replan quarantined the key and, completed, placed
    exactly its one order under another key, recorded by its receipts; an abort failed
    the run with no order of its own; and the stale decision's refusal is on record (when
    the drill saw it before deciding). A run that completed without any decision fails."""
    if "reviews" not in record.options.faults:
        return []
    runs = (record.reviews or {}).get("runs", {})
    judged, waiting, problems = 0, 0, []
    for run_id, info in sorted(runs.items()):
        facts = evidence.runs.get(run_id)
        if facts is None or run_id in record.corrupted or run_id in rewound:
            continue
        problems += _problems(record, facts, info)
        if _consumed_fresh(record, facts):
            judged += 1
        elif facts.phase == "needs_review":
            waiting += 1
    return [
        Invariant(
            "reviews_decided_once",
            "fail" if problems else ("pass" if judged else "unknown"),
            f"{len(runs)} conflicts planted, {judged} decided by the drill's reviewer and "
            f"consumed, {waiting} still in review; {len(problems)} problems"
            + (f": {'; '.join(problems[:4])}" if problems else ""),
            len(runs),
        )
    ]


def reviews_summary(record: DrillRecord) -> dict[str, Any]:
    """The reviews fault for the report: runs, verdicts, and decisions by kind."""
    log = record.reviews or {}
    kinds: dict[str, int] = {}
    for d in log.get("decisions", []):
        kinds[str(d.get("kind"))] = kinds.get(str(d.get("kind")), 0) + 1
    start = record.started_at
    keep = ("run", "kind", "posted", "post_refused", "refused", "stale_refusal_seen")
    return {
        "runs": {r: i.get("verdict") for r, i in sorted(log.get("runs", {}).items())},
        "decisions": kinds,
        "env_moves": len(log.get("env_moves", [])),
        "timeline": [
            {**{k: d[k] for k in keep if k in d}, "t_s": round(float(d["at"]) - start, 2)}
            for d in log.get("decisions", [])
        ],
    }
