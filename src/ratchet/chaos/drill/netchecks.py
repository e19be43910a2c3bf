"""The invariants of the network faults (:mod:`ratchet.chaos.drill.netfaults`).

Each judges by identity: the partitioned worker's process, run and lease version; the run
whose orders link was cut; the runs at their order step when the orders service died. It
reads Redis' history, the workers' acks and restores, and the adapters' own records, never
counts whose size depends on timing. ``unknown`` when the fault never fired, or fired with
nothing at stake (no takeover during a partition, no call while the link was cut).
"""

from __future__ import annotations

from typing import Any

from ratchet.chaos.drill.evidence import Evidence, RunFacts
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.plan import DrillRecord
from ratchet.chaos.drill.services import order_body
from ratchet.chaos.drill.storechecks import accepted_after_takeover, ack_lost

__all__ = [
    "cut_orders_settled_once",
    "net_fired",
    "net_invariants",
    "net_summary",
    "orders_restart_one_order",
    "partition_fenced",
]

_UNSETTLED = ("active", "unreadable")
#: The invariant each network fault is judged by.
NET_INVARIANTS = {
    "partition-store": "partitioned_workers_fenced",
    "partition-reply": "reply_partition_acks_kept",
    "partition-adapter": "cut_orders_settled_once",
    "orders-kill": "orders_restart_one_order",
}


def _status(bad: int, evidence: int) -> str:
    if bad:
        return "fail"
    return "pass" if evidence else "unknown"


def _faults(record: DrillRecord, kind: str) -> list[dict[str, Any]]:
    return [f for f in record.net_faults if f.get("kind") == kind]


def _skipped(record: DrillRecord, kind: str) -> str:
    why = record.net_skipped.get(kind)
    return f"; skipped: {why}" if why else ""


def net_fired(record: DrillRecord) -> dict[str, int]:
    """How often each network fault fired (for ``every_fault_fired``): a partition with a
    takeover during it, a cut the run's worker called through, a kill and restart."""
    return {
        "partition-store": sum(
            1 for f in _faults(record, "partition-store") if f.get("taken_over_by")
        ),
        "partition-reply": sum(
            1 for f in _faults(record, "partition-reply") if f.get("taken_over_by")
        ),
        "partition-adapter": sum(
            1 for f in _faults(record, "partition-adapter") if f.get("calls_cut")
        ),
        "orders-kill": sum(1 for f in _faults(record, "orders-kill") if f.get("restarted_at")),
    }


def _doubled(facts: RunFacts) -> list[str]:
    """Two orders for the run, or any effect of it doubled."""
    orders = sum(facts.adapters.order_effects.values())
    if orders > 1 or facts.adapters.duplicates:
        return [f"{facts.run_id}: {orders} orders, {facts.adapters.duplicates} doubled"]
    return []


def _completed_once(facts: RunFacts) -> list[str]:
    """A completed run without exactly its one order, or with an effect no receipt of it
    records."""
    if facts.phase != "completed":
        return []
    problems = []
    if facts.adapters.order_effects.get(order_body(facts.index), 0) != 1:
        problems.append(f"{facts.run_id}: completed without its one order")
    if not facts.adapters.receipt_keys <= facts.executed_keys:
        problems.append(f"{facts.run_id}: an effect its receipts do not record")
    return problems


def _settled(facts: RunFacts, record: DrillRecord) -> list[str]:
    if facts.status in _UNSETTLED and facts.run_id not in record.corrupted:
        return [f"{facts.run_id}: unsettled ({facts.status})"]
    return []


def partition_fenced(record: DrillRecord, evidence: Evidence, kind: str) -> Invariant:
    """``partition-store`` / ``partition-reply``: for each partitioned worker (pid) whose
    run was taken over during the partition (a later lease in Redis, or a restore under
    one): no commit under its lease at a generation above the one the later lease
    restored (Redis' history and the acks: it would have been accepted after the
    takeover), no ack of it lost, no stale commit or write of it accepted, no committed
    workspace write under a lower lease after a higher one, no doubled effect, and its
    run settled."""
    name = NET_INVARIANTS[kind]
    judged, problems, refused = 0, [], 0
    for fault in _faults(record, kind):
        run_id, version, pid = str(fault["run_id"]), int(fault["lease_version"]), fault["pid"]
        facts = evidence.runs.get(run_id)
        later = fault.get("taken_over_by") is not None or any(
            e.get("run_id") == run_id and int(e.get("lease_version", 0)) > version
            for e in evidence.events.get("restore", [])
        )
        if facts is None or not later:
            continue
        judged += 1
        problems += accepted_after_takeover(run_id, facts, evidence, lease_version=version)
        mine = [
            e
            for k in ("ack", "stale_commit", "stale_write", "job_end")
            for e in evidence.events.get(k, [])
            if e.get("pid") == pid
            and e.get("run_id") == run_id
            and e.get("lease_version") == version
        ]
        for event in mine:
            if event["kind"] == "ack" and ack_lost(event, facts):
                problems.append(f"{run_id} ack g{event['generation']} lost")
            if event["kind"] in ("stale_commit", "stale_write"):
                if event.get("outcome") == "accepted":
                    problems.append(f"{run_id} {event['kind']} accepted under lease {version}")
                else:
                    refused += 1
            if event["kind"] == "job_end" and event.get("outcome") in ("lease_lost",):
                refused += 1
        if facts.adapters.lease_inversions:
            problems.append(f"{run_id}: a workspace write under a lower lease after a higher")
        if facts.adapters.duplicates:
            problems.append(f"{run_id}: {facts.adapters.duplicates} doubled effects")
        problems += _settled(facts, record)
    faults = len(_faults(record, kind))
    return Invariant(
        name,
        _status(len(problems), judged),
        f"{faults} partitions, {judged} taken over while cut, {refused} refusals logged by "
        f"the cut worker; {len(problems)} problems"
        + (f": {'; '.join(problems[:4])}" if problems else "")
        + _skipped(record, kind),
        faults,
    )


def cut_orders_settled_once(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``partition-adapter``: every run whose worker called the orders service while its
    link was cut (the call timed out, its outcome unknown) has at most one order, exactly
    one when it completed, recorded by its receipt, and settled."""
    judged, problems = 0, []
    for fault in _faults(record, "partition-adapter"):
        facts = evidence.runs.get(str(fault["run_id"]))
        if facts is None or not fault.get("calls_cut"):
            continue
        judged += 1
        problems += _doubled(facts) + _completed_once(facts) + _settled(facts, record)
    faults = len(_faults(record, "partition-adapter"))
    return Invariant(
        "cut_orders_settled_once",
        _status(len(problems), judged),
        f"{faults} orders links cut, {judged} with a call cut; {len(problems)} problems"
        + (f": {'; '.join(problems[:4])}" if problems else "")
        + _skipped(record, "partition-adapter"),
        faults,
    )


def orders_restart_one_order(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``orders-kill``: across the restart no run has two orders; every run that was at
    its order step when the service died settled, with exactly one order if it
    completed, recorded by its receipt."""
    kills = _faults(record, "orders-kill")
    restarted = [f for f in kills if f.get("restarted_at")]
    problems = [p for facts in evidence.runs.values() for p in _doubled(facts)] if restarted else []
    at_order = sorted({str(r) for f in restarted for r in f.get("runs_at_order", [])})
    for run_id in at_order:
        facts = evidence.runs.get(run_id)
        if facts is None:
            problems.append(f"{run_id}: no facts")
            continue
        problems += _completed_once(facts)
        problems += _settled(facts, record)
    return Invariant(
        "orders_restart_one_order",
        _status(len(problems), len(restarted)),
        f"{len(restarted)} kills and restarts of the orders service, {len(at_order)} runs at "
        f"their order step; {len(problems)} problems"
        + (f": {'; '.join(problems[:4])}" if problems else "")
        + _skipped(record, "orders-kill"),
        len(restarted),
    )


def net_invariants(record: DrillRecord, evidence: Evidence) -> list[Invariant]:
    """The invariant of every network fault the drill was asked for."""
    wanted = record.options.faults
    out = []
    for kind in ("partition-store", "partition-reply"):
        if kind in wanted:
            out.append(partition_fenced(record, evidence, kind))
    if "partition-adapter" in wanted:
        out.append(cut_orders_settled_once(record, evidence))
    if "orders-kill" in wanted:
        out.append(orders_restart_one_order(record, evidence))
    return out


_SUMMARY = (
    "kind",
    "at",
    "healed_at",
    "restarted_at",
    "run_id",
    "pid",
    "lease_version",
    "taken_over_by",
    "directions",
    "calls_cut",
    "runs_at_order",
)


def net_summary(record: DrillRecord) -> list[dict[str, Any]]:
    """The network faults for the report: what each hit, when it started and ended."""
    return [{k: f[k] for k in _SUMMARY if k in f} for f in record.net_faults]
