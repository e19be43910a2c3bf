"""The drill's checker: each invariant from the records, as pass, fail or unknown.

``unknown`` means the fault an invariant needs never fired (no zombie ever sent a late
write, no rollback happened), so a zero there proves nothing; the verdict is ``pass``
only when every invariant passed.

Definitions (the same as ``docs/drills.md``):

* an **intent** is one planned write of a run (two file writes and one order); an
  **effect** is a committed write in the workspace journal or an order in the service's
  database (the adapters' own records); a duplicate is a second effect of one intent;
* an **acknowledged** checkpoint is a commit whose success a worker saw (its event log's
  ``ack``); it is **lost** when Redis' final high-water mark is below it, or the history
  holds another checkpoint at its generation. A **restore at an older generation** is an
  accepted restore under lease L below an ack made under a lease before L;
* a **stale commit / write** is one a worker sent after it was paused past its lease and
  another worker took over (the lease is no longer its own in Redis when it sends);
  accepted means Redis committed it / the adapter returned a receipt. Redis' history (a
  commit under a lower lease version after one under a higher) and the workspace journal
  (the same for writes) are checked too;
* **stuck**: not terminal, not visibly waiting, not frozen with an incident, once the
  settle bound after the last fault has passed;
* a **rewound** run is one whose generation went back in the AOF rollback. Acks it lost
  are the fault's doing (counted apart, ``acked_lost_to_rollback``); it must end frozen
  with evidence, continue with every adapter effect recorded and none doubled, or be
  cancelled by an operator with its signed ``cancelled`` event saying the environment was
  not the checkpoint's. Any other run that ends frozen or in review is an unexpected
  conflict;
* an **operator cancel** is a ``ratchet cancel`` the drill makes of a run still in
  flight; the run must end (cancelled, or completed first), and every cancelled run's
  signed ``cancelled`` event must name the drill's request for it;
* **metrics**: each worker's counters as its last successful scrape showed them, summed
  over workers (``_metrics`` below states exactly what is compared and why).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ratchet.chaos.drill.evidence import Evidence, RunFacts
from ratchet.chaos.drill.humanchecks import approvals_fired, human_invariants
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.netchecks import net_fired, net_invariants, net_summary
from ratchet.chaos.drill.plan import DrillRecord
from ratchet.chaos.drill.reviewchecks import (
    planted_review_waiting,
    review_invariants,
    reviews_fired,
    reviews_summary,
)
from ratchet.chaos.drill.scrape import MetricsWatch
from ratchet.chaos.drill.services import INTENTS_PER_RUN
from ratchet.chaos.drill.storechecks import (
    corrupted_runs_frozen,
    fenced_stale_writes,
    owner_collision_fenced,
    redis_pause_fenced,
    slow_store_acks_kept,
    store_full_acks_kept,
    wiped_store_ran_nothing,
)
from ratchet.chaos.drill.workspacechecks import (
    workspace_fired,
    workspace_invariants,
    workspace_summary,
)
from ratchet.ops.diagnosis import FREEZING_KINDS

__all__ = ["Invariant", "Verdicts", "check"]

_WRITE_WINDOWS = (
    "after_pending_before_adapter",
    "after_adapter_before_receipt",
    "after_receipt_before_state",
    "after_guard_before_adapter",
    "workspace_after_intent",
    "workspace_after_replace",
)


@dataclass
class Verdicts:
    invariants: list[Invariant]
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if any(i.status == "fail" for i in self.invariants):
            return "fail"
        if any(i.status == "unknown" for i in self.invariants):
            return "unknown"
        return "pass"

    @property
    def failed(self) -> list[str]:
        return [i.name for i in self.invariants if i.status == "fail"]


def _status(bad: int, evidence: int) -> str:
    if bad:
        return "fail"
    return "pass" if evidence else "unknown"


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))], 1)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 1)}


def _takeovers(evidence: Evidence) -> list[float]:
    acquires: dict[str, list[tuple[float, int]]] = {}
    for event in evidence.events.get("acquire", []):
        acquires.setdefault(str(event["run_id"]), []).append(
            (float(event["at"]), int(event["lease_version"]))
        )
    out = []
    for hit in evidence.fired:
        if hit.get("action") == "delay" or not isinstance(hit.get("run_id"), str):
            continue
        later = [
            at
            for at, version in acquires.get(hit["run_id"], [])
            if version > int(hit.get("lease_version") or 0) and at >= hit["at"]
        ]
        if later:
            out.append((min(later) - float(hit["at"])) * 1000)
    return out


def _later_leases(evidence: Evidence) -> set[tuple[str, int]]:
    """``(run, lease version)`` of every acquire that replaced an earlier lease of its run
    (each acquire event names the lease it replaced; 0: the run had never been leased)."""
    return {
        (str(e["run_id"]), int(e["lease_version"]))
        for e in evidence.events.get("acquire", [])
        if int(e.get("previous_lease_version") or 0) > 0
    }


def _rewound(record: DrillRecord) -> dict[str, tuple[int, int]]:
    if record.rollback is None:
        return {}
    return {r: (int(v[0]), int(v[1])) for r, v in record.rollback["rewound"].items()}


def _failover_losses(record: DrillRecord, evidence: Evidence) -> dict[str, list[dict[str, Any]]]:
    """The acks each run lost to a failover (replicated topology): made before a promotion
    (the first one after the ack) at a generation the promoted primary did not hold."""
    lost: dict[str, list[dict[str, Any]]] = {}
    for ack in evidence.events.get("ack", []):
        at = float(ack["at"])
        failover = next((f for f in record.failovers if at < float(f["promoted_at"])), None)
        if failover is None:
            continue
        run_id = str(ack["run_id"])
        if int(ack["generation"]) > int(failover["kept"].get(run_id, 0)):
            lost.setdefault(run_id, []).append(ack)
    return lost


def _acks(
    evidence: Evidence, record: DrillRecord, failover_lost: dict[str, list[dict[str, Any]]]
) -> dict[str, int]:
    rewound = _rewound(record)
    cut_at = record.rollback["at"] if record.rollback else None
    lost = lost_to_rollback = older = 0
    acks_by_run: dict[str, list[dict[str, Any]]] = {}
    for ack in evidence.events.get("ack", []):
        acks_by_run.setdefault(str(ack["run_id"]), []).append(ack)
    for run_id, acks in acks_by_run.items():
        facts = evidence.runs.get(run_id)
        if facts is None:
            continue
        by_generation = {g: d for g, _, d in facts.history}
        gone = failover_lost.get(run_id, [])
        gone_ids = {id(a) for a in gone}
        for ack in acks:
            if id(ack) in gone_ids:
                continue  # counted apart: lost to a failover
            generation = int(ack["generation"])
            before_cut = cut_at is not None and float(ack["at"]) < cut_at
            if run_id in rewound and before_cut:
                if generation > rewound[run_id][1]:
                    lost_to_rollback += 1
                continue
            kept = by_generation.get(generation)
            if (
                facts.generation is None
                or facts.generation < generation
                or (kept is not None and kept != ack["digest"])
            ):
                lost += 1
        if run_id in rewound or gone:
            continue  # its restores after the rewind are judged by the conflict check
        for restore in evidence.events.get("restore", []):
            if restore["run_id"] != run_id:
                continue
            older += sum(
                1
                for a in acks
                if int(a["lease_version"]) < int(restore["lease_version"])
                and int(a["generation"]) > int(restore["generation"])
            )
    return {
        "acked": sum(len(a) for a in acks_by_run.values()),
        "lost": lost,
        "lost_to_rollback": lost_to_rollback,
        "lost_to_failover": sum(len(g) for g in failover_lost.values()),
        "older_restores": older,
    }


def _failover_acks_kept(record: DrillRecord, lost: int) -> Invariant:
    """``failover_acks_kept``, judged with the acknowledgement rule only: no ack is lost to
    a failover. Without the rule losses are what asynchronous replication allows: the
    figures count them (``acked_lost_to_failover``), no invariant judges them."""
    fired = len(record.failovers)
    return Invariant(
        "failover_acks_kept",
        "fail" if lost else ("pass" if fired else "unknown"),
        f"{fired} failovers, {lost} acks lost with "
        f"{record.options.min_replicas_ack} replicas confirming each",
        fired,
    )


def _history_inversions(facts: RunFacts) -> int:
    inversions, newest_seen = 0, None
    for _, lease_version, _ in facts.history:  # newest first
        if newest_seen is not None and lease_version > newest_seen:
            inversions += 1  # an older commit held a higher lease than a newer one
        newest_seen = lease_version if newest_seen is None else min(newest_seen, lease_version)
    return inversions


def _consistent(facts: RunFacts) -> bool:
    """Every effect the adapters hold is recorded by the run, and none is doubled."""
    return facts.adapters.duplicates == 0 and facts.adapters.receipt_keys <= facts.executed_keys


def check(record: DrillRecord, evidence: Evidence) -> Verdicts:
    """Judge every invariant. Never raises for what the records say."""
    runs = evidence.runs
    hits = Counter(str(f.get("window")) for f in evidence.fired)
    actions = Counter(str(f.get("action")) for f in evidence.fired)
    rewound = _rewound(record)
    ttl_ms = record.options.ttl_ms
    invariants: list[Invariant] = []

    # 1. Exactly one external effect per intent.
    duplicates = sum(f.adapters.duplicates for f in runs.values())
    incomplete = [
        r
        for r, f in runs.items()
        if (
            f.phase == "completed" and (f.adapters.effects != INTENTS_PER_RUN or not _consistent(f))
        )
        # A journal the checker could not recover holds no final answer: fail closed.
        or f.adapters.journal_check.startswith("not recovered")
    ]
    write_faults = sum(hits[w] for w in _WRITE_WINDOWS) + len(record.redis_kills)
    invariants.append(
        Invariant(
            "one_effect_per_intent",
            _status(duplicates + len(incomplete), write_faults),
            f"{duplicates} duplicate effects; {len(incomplete)} completed runs whose adapter "
            "records differ from their receipts",
            write_faults,
        )
    )

    # 2. No acknowledged checkpoint lost; no restore at an older generation. Acks lost to
    # a failover are counted apart; their runs are judged as rewound (6).
    failover_lost = _failover_losses(record, evidence)
    acks = _acks(evidence, record, failover_lost)
    rewound = {
        **{r: (max(int(a["generation"]) for a in gone), 0) for r, gone in failover_lost.items()},
        **rewound,
    }
    later_leases = _later_leases(evidence)
    takeovers = [
        e
        for e in evidence.events.get("restore", [])
        if (str(e["run_id"]), int(e["lease_version"])) in later_leases
    ]
    ack_faults = len(takeovers) + len(record.redis_kills)
    invariants.append(
        Invariant(
            "no_acked_checkpoint_lost",
            _status(acks["lost"] + acks["older_restores"], acks["acked"] and ack_faults),
            f"{acks['acked']} acknowledged commits, {acks['lost']} lost, "
            f"{acks['older_restores']} restores below an earlier lease's ack; "
            f"{acks['lost_to_rollback']} lost to the injected rollback (expected), "
            f"{acks['lost_to_failover']} to a failover",
            ack_faults,
        )
    )
    if record.options.min_replicas_ack:
        invariants.append(_failover_acks_kept(record, acks["lost_to_failover"]))

    # 3 and 4. Stale commits and writes: attempted in zombie drills, never accepted.
    commits = evidence.events.get("stale_commit", [])
    commits_accepted = sum(1 for c in commits if c["outcome"] == "accepted") + sum(
        _history_inversions(f) for f in runs.values()
    )
    invariants.append(
        Invariant(
            "stale_commits_rejected",
            _status(commits_accepted, len(commits)),
            f"{len(commits)} stale commits attempted, {commits_accepted} accepted",
            hits["after_guard_before_commit"],
        )
    )
    writes = evidence.events.get("stale_write", [])
    # Accepted past a newer lease's fence, or a lower lease committed after a higher one
    # in an adapter's own records.
    past_fence = len(fenced_stale_writes(record, evidence))
    writes_accepted = past_fence + sum(f.adapters.lease_inversions for f in runs.values())
    by_fence = sum(1 for w in writes if w["outcome"] == "refused")
    unfenced = sum(1 for w in writes if w["outcome"] == "accepted") - past_fence
    invariants.append(
        Invariant(
            "stale_writes_refused",
            _status(writes_accepted, len(writes)),
            f"{len(writes)} stale writes attempted, {by_fence} refused by a fence, "
            f"{writes_accepted} accepted past a newer fence; {unfenced} sent before any newer "
            "lease had restored (no newer fence to meet; their effects judged once each)",
            hits["after_guard_before_adapter"],
        )
    )

    # 5. Every run ends terminal or visibly waiting; none stuck past the bound.
    # A corrupted run is never to settle by itself: corrupted_runs_frozen judges it.
    stuck = sorted(
        r
        for r, f in runs.items()
        if f.status in ("active", "unreadable") and r not in record.corrupted
    )
    deaths = len(record.deaths) + len(record.pauses)
    invariants.append(
        Invariant(
            "no_run_stuck",
            _status(len(stuck), deaths),
            f"{len(stuck)} runs unsettled {record.options.settle_bound_s:.0f} s after the "
            f"last fault{': ' + ', '.join(stuck[:5]) if stuck else ''}",
            deaths,
        )
    )

    # 6. Conflicts frozen with evidence; rewound runs never continue silently.
    # A run still waiting for its approver (the approvals actor gave up on it) is not a
    # conflict: it waits with its lease released, as it should. One the rollback put back
    # at its approval whose restore was refused is frozen all the same: no worker runs it.
    def refused(f: RunFacts) -> bool:
        return any(i.get("kind") in FREEZING_KINDS and i.get("reason") for i in f.incidents)

    frozen = {
        r: f
        for r, f in runs.items()
        if f.status in ("frozen", "waiting")
        and r not in record.corrupted
        and (f.phase != "awaiting_approval" or (r in rewound and refused(f)))
        # A conflict the reviews fault planted, still waiting for its reviewer: expected.
        and not (r not in rewound and planted_review_waiting(record, f))
    }
    no_evidence = [r for r, f in frozen.items() if not (f.review_reason or refused(f))]
    unexpected = [r for r in frozen if r not in rewound]
    # An operator may end a rewound run: its signed cancelled event must then say that the
    # environment was not the checkpoint's (the adapters keep their records).
    ended_by_cancel = [r for r in rewound if r not in frozen and runs[r].cancelled_unreconciled]
    silent = [
        r
        for r in rewound
        if r not in frozen and r not in ended_by_cancel and not _consistent(runs[r])
    ]
    bad = len(no_evidence) + len(unexpected) + len(silent)
    conflict_status = _status(bad, len(rewound))
    if record.rollback_skipped and not bad:
        conflict_status = "unknown"
    invariants.append(
        Invariant(
            "conflicts_frozen_with_evidence",
            conflict_status,
            f"{len(rewound)} runs rewound, {sum(1 for r in rewound if r in frozen)} frozen with "
            f"evidence, {len(ended_by_cancel)} cancelled by an operator with the mismatch "
            "recorded; "
            f"{len(silent)} continued silently; {len(unexpected)} unexpected "
            f"conflicts {unexpected[:3]}; {len(no_evidence)} without evidence"
            + (f"; rollback skipped: {record.rollback_skipped}" if record.rollback_skipped else ""),
            len(rewound),
        )
    )

    # 7. Terminal runs stay terminal.
    ended = [
        e
        for e in evidence.events.get("job_end", [])
        if e.get("phase") in ("completed", "failed", "cancelled") and e["run_id"] not in rewound
    ]
    reopened = sorted(
        {
            str(e["run_id"])
            for e in ended
            if runs.get(e["run_id"]) and runs[e["run_id"]].phase != e["phase"]
        }
    )
    moved = [
        d["run_id"]
        for d in record.duplicate_enqueues
        if d["run_id"] not in rewound and runs[d["run_id"]].generation != d["generation"]
    ]
    invariants.append(
        Invariant(
            "terminal_runs_stay_terminal",
            _status(len(reopened) + len(moved), len(record.duplicate_enqueues)),
            f"{len(record.duplicate_enqueues)} ended runs enqueued again; {len(reopened)} left "
            f"their terminal phase, {len(moved)} committed again",
            len(record.duplicate_enqueues),
        )
    )

    # 8. Operator cancels end runs through the fenced path, attributed; nothing else does.
    asked = {str(c["run_id"]): str(c["request_id"]) for c in record.cancels}
    unattributed = sorted(
        r
        for r, f in runs.items()
        if f.phase == "cancelled" and (f.cancel_request is None or asked.get(r) != f.cancel_request)
    )
    unended = sorted(
        r for r in asked if r in runs and runs[r].status not in ("terminal", "waiting", "frozen")
    )
    cancelled = sum(1 for r in asked if r in runs and runs[r].phase == "cancelled")
    invariants.append(
        Invariant(
            "operator_cancels_end_runs",
            _status(len(unattributed) + len(unended), len(asked)),
            f"{len(asked)} cancels requested, {cancelled} runs cancelled (the rest ended first); "
            f"{len(unattributed)} cancelled runs without their request, {len(unended)} "
            "requested runs still running",
            len(asked),
        )
    )

    # 9. Every requested fault fired.
    fired_kinds = {
        "kill": actions["kill"],
        "pause": actions["pause"],
        "drop-reply": actions["drop-reply"],
        "delay": actions["delay"],
        "raise": actions["raise"],
        "redis-kill": len(record.redis_kills),
        "duplicate-enqueue": len(record.duplicate_enqueues),
        "rollback": 1 if record.rollback else 0,
        "cancel": len(record.cancels),
        "redis-pause": len(record.faults_of("redis-pause")),
        "redis-slow": sum(int(f.get("sleeps", 0)) for f in record.faults_of("redis-slow")),
        "maxmemory": sum(1 for f in record.faults_of("maxmemory") if f.get("refused")),
        "disk-full": sum(1 for f in record.faults_of("disk-full") if f.get("refused")),
        "corrupt-record": len(record.corrupted),
        "owner-collision": len(record.twins) // 2,
        "store-wipe": 1 if record.wipe else 0,
        **approvals_fired(record.humans),
        **net_fired(record),
        **workspace_fired(record, evidence),
        **reviews_fired(record, evidence),
    }
    missing = sorted(k for k in record.options.faults if not fired_kinds.get(k))
    why = {**record.store_skipped, **record.net_skipped, **record.workspace_skipped}
    skipped = {k: v for k, v in why.items() if k in missing}
    invariants.append(
        Invariant(
            "every_fault_fired",
            "unknown" if missing else "pass",
            (f"never fired: {missing}" if missing else "every requested fault fired")
            + "".join(f"; {k} skipped: {v}" for k, v in sorted(skipped.items())),
            sum(fired_kinds.values()),
        )
    )

    # 10. The store faults, each with its own invariant (ratchet.chaos.drill.storechecks).
    wanted = record.options.faults
    for fault, judge in (
        ("redis-pause", redis_pause_fenced),
        ("redis-slow", slow_store_acks_kept),
        ("corrupt-record", corrupted_runs_frozen),
        ("owner-collision", owner_collision_fenced),
        ("store-wipe", wiped_store_ran_nothing),
    ):
        if fault in wanted:
            invariants.append(judge(record, evidence))
    for fault in ("maxmemory", "disk-full"):
        if fault in wanted:
            invariants.append(store_full_acks_kept(record, evidence, fault))
    invariants.extend(human_invariants(record, evidence))  # ratchet.chaos.drill.humanchecks
    invariants.extend(net_invariants(record, evidence))  # ratchet.chaos.drill.netchecks
    invariants.extend(workspace_invariants(record, evidence))  # ...drill.workspacechecks
    invariants.extend(review_invariants(record, evidence, rewound))  # ...drill.reviewchecks

    latency = _takeovers(evidence)
    metrics_invariant, metrics_figures = _metrics(record, evidence, runs, len(latency))
    invariants.append(metrics_invariant)
    pct = _percentiles(latency)
    phases = Counter(f.phase for f in runs.values())
    figures = {
        "runs": len(runs),
        "runs_by_phase": dict(sorted(phases.items())),
        "runs_by_status": dict(sorted(Counter(f.status for f in runs.values()).items())),
        "intents": INTENTS_PER_RUN * len(runs),
        "effects": sum(f.adapters.effects for f in runs.values()),
        "duplicate_effects": duplicates,
        "stale_commits_attempted": len(commits),
        "stale_commits_accepted": commits_accepted,
        "stale_writes_attempted": len(writes),
        "stale_writes_accepted": writes_accepted,
        "stale_writes_refused_by_fence": by_fence,
        "adapter_refusals": {
            "workspace": sum(f.adapters.refused_workspace for f in runs.values()),
            "orders": sum(f.adapters.refused_orders for f in runs.values()),
        },
        "acked_checkpoints": acks["acked"],
        "acked_checkpoints_lost": acks["lost"],
        "acked_lost_to_rollback": acks["lost_to_rollback"],
        "acked_lost_to_failover": acks["lost_to_failover"],
        "failovers": [
            {k: f[k] for k in ("at", "took_s", "killed_port", "promoted_port")}
            for f in record.failovers
        ],
        "rewound_by_failover": sorted(failover_lost),
        "master_kills": [
            {k: m[k] for k in ("at", "port", "runs_on_it", "recovered_s")}
            for m in record.master_kills
        ],
        "restores_at_older_generation": acks["older_restores"],
        "stuck_runs": len(stuck),
        "rewound_runs": len(rewound),
        "operator_cancels": len(record.cancels),
        "takeovers": len(latency),
        "takeover_ms": pct,
        "takeover_ttl_multiple": {
            k: (round(v / ttl_ms, 2) if v is not None else None) for k, v in pct.items()
        },
        "failpoint_hits": dict(sorted(hits.items())),
        "fault_injections": fired_kinds,
        "corrupted_runs": sorted(record.corrupted),
        "store_faults": [
            {
                **{
                    k: v
                    for k, v in f.items()
                    if k in ("kind", "at", "ended_at", "refused", "sleeps")
                },
                **({"leases_live": len(f["leases"])} if "leases" in f else {}),
            }
            for f in record.store_faults
        ],
        "store_faults_skipped": dict(sorted(record.store_skipped.items())),
        "net_faults": net_summary(record),
        "net_faults_skipped": dict(sorted(record.net_skipped.items())),
        "workspace_faults": workspace_summary(record, evidence),
        "workspace_faults_skipped": dict(sorted(record.workspace_skipped.items())),
        "reviews": reviews_summary(record),
        "worker_exits": len(record.deaths),
        "zombies_resumed": len(record.pauses),
        "metrics": metrics_figures,
    }
    return Verdicts(invariants, figures)


_FENCE_REFUSALS = frozenset({"LeaseLostError", "GenerationMismatchError", "StaleStateError"})
# A refused commit or adapter call ends its job at once with one of these outcomes.
_REFUSED_JOBS = frozenset({"lease_lost", "restore_refused"})


def _covered(event: dict[str, Any], watch: MetricsWatch) -> bool:
    """The worker's last successful scrape began after ``event`` was logged. Every event
    is logged after the counter it goes with was incremented, so that scrape saw it."""
    last = watch.last_scrape(int(event.get("pid", 0)))
    return last is not None and float(event["at"]) <= last


_REASONS = {
    "LeaseLostError": "lease_lost",
    "GenerationMismatchError": "generation_mismatch",
    "StaleStateError": "stale_state",
}


@dataclass
class _WorkerFigures:
    """One worker's events as the drill logged them, by identity: the jobs (run, lease
    version) that could hold a refused commit or adapter call, and the refusals the
    worker itself logged (a zombie's stale attempts), each also as covered by its last
    scrape."""

    acquires: int = 0
    acquires_covered: int = 0
    took_over: int = 0
    took_over_covered: int = 0
    refusable: set[tuple[str, int]] = field(default_factory=set)
    ended_covered: set[tuple[str, int]] = field(default_factory=set)  # job_end scraped
    commits_covered: Counter[str] = field(default_factory=Counter)  # by reason
    commits_logged: int = 0
    writes_covered: int = 0
    writes_logged: int = 0


def _per_worker(evidence: Evidence, watch: MetricsWatch) -> dict[int, _WorkerFigures]:
    """Each scraped worker's figures (see :class:`_WorkerFigures`).

    A job can refuse at most one commit and one adapter call: either ends it at once, as
    ``lease_lost`` (a commit, or an adapter's fence, refused under a lease really lost:
    a zombie's, a loaded worker whose renewal came too late, a rollback's) or
    ``restore_refused``. So the refusable jobs are those that ended so, plus jobs whose
    end was never logged (the process died first) and the zombies' logged attempts.
    """
    figures = {pid: _WorkerFigures() for pid in watch.workers}
    ended: set[tuple[int, str, int]] = set()
    for e in evidence.events.get("job_end", []):
        pid = int(e.get("pid", 0))
        if pid not in figures or not isinstance(e.get("lease_version"), int):
            continue
        job = (str(e["run_id"]), int(e["lease_version"]))
        ended.add((pid, *job))
        if _covered(e, watch):
            figures[pid].ended_covered.add(job)
        if e.get("outcome") in _REFUSED_JOBS:
            figures[pid].refusable.add(job)
    for e in evidence.events.get("acquire", []):
        pid = int(e.get("pid", 0))
        if pid not in figures:
            continue
        f, covered = figures[pid], _covered(e, watch)
        f.acquires += 1
        f.acquires_covered += covered
        if e.get("took_over"):
            f.took_over += 1
            f.took_over_covered += covered
        job = (str(e["run_id"]), int(e["lease_version"]))
        if (pid, *job) not in ended:
            f.refusable.add(job)
    for e in evidence.events.get("stale_commit", []):
        pid = int(e.get("pid", 0))
        if pid not in figures or e.get("outcome") != "rejected":
            continue
        reason = _REASONS.get(str(e.get("error")))
        if reason is None:
            continue
        figures[pid].refusable.add((str(e["run_id"]), int(e["lease_version"])))
        figures[pid].commits_logged += 1
        if _covered(e, watch):
            figures[pid].commits_covered[reason] += 1
    for e in evidence.events.get("stale_write", []):
        pid = int(e.get("pid", 0))
        if pid not in figures or e.get("outcome") != "refused":
            continue
        figures[pid].refusable.add((str(e["run_id"]), int(e["lease_version"])))
        figures[pid].writes_logged += 1
        figures[pid].writes_covered += _covered(e, watch)
    return figures


def _worker_problems(watch: MetricsWatch, figures: dict[int, _WorkerFigures]) -> list[str]:
    """Every worker's counters against its own logged events (see ``_metrics``)."""
    problems: list[str] = []
    for pid, f in sorted(figures.items()):
        scrape = watch.workers[pid]
        if scrape.values is None:
            continue  # never scraped: it has no counts to compare
        by_reason = {
            r: round(scrape.total("ratchet_stale_commits_refused_total", reason=r))
            for r in _REASONS.values()
        }
        commits = sum(by_reason.values())
        writes = round(scrape.total("ratchet_stale_adapter_writes_refused_total"))
        took = round(scrape.total("ratchet_leases_taken_over_total"))
        acquired = round(scrape.total("ratchet_leases_acquired_total"))
        short = [r for r, n in f.commits_covered.items() if by_reason.get(r, 0) < n]
        if short or commits > len(f.refusable):
            problems.append(
                f"worker {pid}: stale commits {by_reason} against {dict(f.commits_covered)} "
                f"refusals it logged and scraped, at most {len(f.refusable)} refusable jobs"
            )
        if not f.writes_covered <= writes <= len(f.refusable):
            problems.append(
                f"worker {pid}: stale adapter writes {writes} not within "
                f"[{f.writes_covered}, {len(f.refusable)}]"
            )
        if not f.took_over_covered <= took <= f.took_over:
            problems.append(
                f"worker {pid}: takeovers {took} not within [{f.took_over_covered}, "
                f"{f.took_over}] acquires of an expired lease"
            )
        if not f.acquires_covered <= acquired <= f.acquires:
            problems.append(
                f"worker {pid}: leases acquired {acquired} not within "
                f"[{f.acquires_covered}, {f.acquires}]"
            )
    return problems


def _jobs_across_rollback(record: DrillRecord, evidence: Evidence) -> int:
    """Jobs that were not zombies, acquired before Redis came back from the rollback and
    ended ``lease_lost`` after it was killed for it: the only ones whose commit a rollback
    can have made stale."""
    if record.rollback is None:
        return 0
    back = float(record.rollback["at"])
    killed = float(record.rollback.get("killed_at", back))
    zombies = {
        (str(e["run_id"]), int(e["lease_version"])) for e in evidence.events.get("stale_commit", [])
    }
    began = {
        (str(e["run_id"]), int(e["lease_version"]), int(e["pid"]))
        for e in evidence.events.get("acquire", [])
        if float(e["at"]) < back
    }
    return sum(
        1
        for e in evidence.events.get("job_end", [])
        if e.get("outcome") == "lease_lost"
        and float(e["at"]) > killed
        and isinstance(e.get("lease_version"), int)
        and (str(e["run_id"]), int(e["lease_version"]), int(e["pid"])) in began
        and (str(e["run_id"]), int(e["lease_version"])) not in zombies
    )


def _metrics(
    record: DrillRecord, evidence: Evidence, runs: dict[str, RunFacts], report_takeovers: int
) -> tuple[Invariant, dict[str, Any]]:
    """``metrics_match_report``: each worker's scraped counters against what that worker
    logged, by identity (which worker, which job, which kind of refusal), never against
    totals whose split depends on timing.

    For every scraped worker (a counter moves before its event is logged, so an event
    logged before the worker's last scrape began is in that scrape: *covered*):

    * stale commits, by reason: at least the zombie refusals it logged and that were
      covered, of each reason (``LeaseLostError`` -> ``lease_lost``, ...); in all at most
      its refusable jobs (a refused commit ends its job ``lease_lost``: a zombie's, or a
      real lease loss on a loaded machine, or one a rollback made stale; or a job whose
      end was never logged);
    * stale adapter writes: at least its covered zombie refusals, at most its refusable
      jobs; and over the fleet, every refusal the adapters recorded (``refused_stale``)
      reached some worker: adapter refusals - refused jobs no scrape covered <= sum <=
      adapter refusals;
    * takeovers: between its covered and all its ``acquire`` events that took over an
      expired lease (each event says so: ``took_over``);
    * leases acquired: between its covered and all its ``acquire`` events.

    ``unknown`` when no worker could be scraped.
    """
    watch = record.metrics
    if watch is None or not watch.scraped:
        return (
            Invariant("metrics_match_report", "unknown", "no worker's metrics could be scraped", 0),
            {"workers_scraped": 0},
        )
    scraped = {w.pid for w in watch.scraped}
    events = [e for kind in evidence.events.values() for e in kind if "pid" in e]
    tail: set[int] = set()  # could have counted after their last scrape
    for event in events:
        pid = int(event["pid"])
        if pid in watch.workers and not _covered(event, watch):
            tail.add(pid)
    per_worker = _per_worker(evidence, watch)
    # Refusable jobs whose end no scrape covered (ended later, or never logged its end):
    # each may hold one refusal the counters do not show.
    unsettled = {pid: f.refusable - f.ended_covered for pid, f in per_worker.items()}
    refusal_tail = {pid for pid, jobs in unsettled.items() if jobs}
    unscraped_jobs = sum(len(jobs) for jobs in unsettled.values())

    takeovers = watch.total("ratchet_leases_taken_over_total")
    acquired = watch.total("ratchet_leases_acquired_total")
    commits = watch.total("ratchet_stale_commits_refused_total")
    writes = watch.total("ratchet_stale_adapter_writes_refused_total")
    requeues = watch.total("ratchet_reaper_requeues_total")

    zombie_commits = [
        c
        for c in evidence.events.get("stale_commit", [])
        if c["outcome"] == "rejected" and c.get("error") in _FENCE_REFUSALS
    ]
    zombie_writes = [w for w in evidence.events.get("stale_write", []) if w["outcome"] == "refused"]
    adapter_refusals = sum(
        f.adapters.refused_workspace + f.adapters.refused_orders for f in runs.values()
    )
    problems = _worker_problems(watch, per_worker)
    covered_writes = sum(f.writes_covered for f in per_worker.values())
    exact = unscraped_jobs == 0
    low_writes = max(covered_writes, adapter_refusals - unscraped_jobs)
    if not low_writes <= writes <= adapter_refusals:
        problems.append(
            f"stale adapter writes {writes} not within [{low_writes}, "
            f"{adapter_refusals}]: {adapter_refusals} adapter refusals, "
            f"{unscraped_jobs} refused jobs unscraped, {covered_writes} zombie "
            "refusals scraped"
        )
    lower_takeovers = sum(f.took_over_covered for f in per_worker.values())
    upper_takeovers = sum(f.took_over for f in per_worker.values())
    refusable = sum(len(f.refusable) for f in per_worker.values())
    spanning = _jobs_across_rollback(record, evidence)

    figures: dict[str, Any] = {
        "workers_spawned": len(watch.workers),
        "workers_scraped": len(scraped),
        "workers_never_scraped": len(watch.workers) - len(scraped),
        "workers_died_unscraped": len(tail),
        "workers_refusals_maybe_unscraped": len(refusal_tail),
        "scrape_rounds": watch.rounds,
        "scrape_seconds": round(watch.spent_s, 2),
        "takeovers": takeovers,
        "takeovers_bounds": [lower_takeovers, upper_takeovers],
        "report_takeovers": report_takeovers,
        "leases_acquired": acquired,
        "stale_commits_refused": commits,
        "stale_commits_refused_by_reason": {
            r: watch.total("ratchet_stale_commits_refused_total", reason=r)
            for r in ("lease_lost", "generation_mismatch", "stale_state")
        },
        "stale_adapter_writes_refused": writes,
        "stale_adapter_writes_refused_by_call": {
            c: watch.total("ratchet_stale_adapter_writes_refused_total", call=c)
            for c in ("execute", "raise_fence")
        },
        "stale_refusals": commits + writes,
        "report_stale_commits_refused": len(zombie_commits),
        "jobs_across_rollback": spanning,
        "refusable_jobs": refusable,
        "report_stale_writes_refused": len(zombie_writes),
        "report_adapter_refusals": adapter_refusals,
        "reaper_requeues": requeues,
        "reaper_requeues_by_cause": {
            c: watch.total("ratchet_reaper_requeues_total", cause=c)
            for c in ("lease_expired", "released", "unknown")
        },
        "refused_jobs_unscraped": unscraped_jobs,
        "exact": exact,
    }
    detail = (
        "; ".join(problems)
        if problems
        else (
            f"{len(scraped)}/{len(watch.workers)} workers scraped; stale refusals {commits} "
            f"commits + {writes} adapter writes (drill: {len(zombie_commits)} zombie commits, "
            f"{adapter_refusals} adapter refusals, {'exact' if exact else 'bounded'}); "
            f"takeovers {takeovers} in [{lower_takeovers}, {upper_takeovers}]; "
            f"{len(tail)} workers died with counts after their last scrape"
        )
    )
    return (
        Invariant("metrics_match_report", "fail" if problems else "pass", detail, len(scraped)),
        figures,
    )
