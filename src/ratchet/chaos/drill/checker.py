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
from ratchet.chaos.drill.runner import DrillRecord
from ratchet.chaos.drill.scrape import MetricsWatch
from ratchet.chaos.drill.services import INTENTS_PER_RUN

__all__ = ["Invariant", "Verdicts", "check"]

_WRITE_WINDOWS = (
    "after_pending_before_adapter",
    "after_adapter_before_receipt",
    "after_receipt_before_state",
    "after_guard_before_adapter",
)


@dataclass(frozen=True, slots=True)
class Invariant:
    name: str
    status: str  # pass | fail | unknown
    detail: str
    injections: int  # faults behind this verdict

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail, "injections": self.injections}


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


def _acks(evidence: Evidence, record: DrillRecord) -> dict[str, int]:
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
        for ack in acks:
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
        if run_id in rewound:
            continue  # its restores after the rollback are judged by the conflict check
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
        "older_restores": older,
    }


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
        if f.phase == "completed" and (f.adapters.effects != INTENTS_PER_RUN or not _consistent(f))
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

    # 2. No acknowledged checkpoint lost; no restore at an older generation.
    acks = _acks(evidence, record)
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
            f"{acks['lost_to_rollback']} lost to the injected rollback (expected)",
            ack_faults,
        )
    )

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
    writes_accepted = sum(1 for w in writes if w["outcome"] == "accepted") + sum(
        f.adapters.lease_inversions for f in runs.values()
    )
    by_fence = sum(1 for w in writes if w["outcome"] == "refused")
    invariants.append(
        Invariant(
            "stale_writes_refused",
            _status(writes_accepted, len(writes)),
            f"{len(writes)} stale writes attempted, {by_fence} refused by a fence, "
            f"{writes_accepted} accepted",
            hits["after_guard_before_adapter"],
        )
    )

    # 5. Every run ends terminal or visibly waiting; none stuck past the bound.
    stuck = sorted(r for r, f in runs.items() if f.status in ("active", "unreadable"))
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
    frozen = {r: f for r, f in runs.items() if f.status in ("frozen", "waiting")}
    no_evidence = [
        r
        for r, f in frozen.items()
        if not (
            f.review_reason
            or any(i.get("kind") == "restore_refused" and i.get("reason") for i in f.incidents)
        )
    ]
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
    }
    missing = sorted(k for k in record.options.faults if not fired_kinds.get(k))
    invariants.append(
        Invariant(
            "every_fault_fired",
            "unknown" if missing else "pass",
            f"never fired: {missing}" if missing else "every requested fault fired",
            sum(fired_kinds.values()),
        )
    )

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


def _lower_takeovers(record: DrillRecord, evidence: Evidence, watch: MetricsWatch) -> int:
    """Leases that must have been taken over, each counted by a scraped worker.

    A lease (run, v) whose holder was SIGKILLed by a ``kill`` failpoint, or stopped by a
    ``pause`` one, was neither finished nor released: the next acquire of that run (the
    one whose event names lease v as the lease it replaced) found it expired and still
    naming its owner, which is what the metric counts. For a pause, that acquire must come
    before the zombie was resumed. Runs the rollback rewound are left out (the lease the
    rewound store names is not the last one granted).
    """
    rewound = _rewound(record)
    resumed = {int(str(p["pid"])): float(p["resumed_at"] or 0) for p in record.pauses}
    acquires: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for event in evidence.events.get("acquire", []):
        replaced = (str(event["run_id"]), int(event.get("previous_lease_version") or 0))
        acquires.setdefault(replaced, []).append(event)
    counted: set[tuple[str, int]] = set()
    for hit in evidence.fired:
        run_id, version = hit.get("run_id"), hit.get("lease_version")
        if (
            hit.get("action") not in ("kill", "pause")
            or not isinstance(run_id, str)
            or not isinstance(version, int)
            or run_id in rewound
        ):
            continue
        until = resumed.get(int(hit["pid"]), 0.0) if hit["action"] == "pause" else None
        for event in acquires.get((run_id, version), []):
            at = float(event["at"])
            if at >= float(hit["at"]) and (until is None or at < until) and _covered(event, watch):
                counted.add((run_id, version))
    return len(counted)


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
    """``metrics_match_report``: the workers' scraped counters against the drill's records.

    * stale adapter writes: every fence refusal an adapter counts in its own records (the
      workspace journal's and the orders service's ``refused_stale``) reaches the worker as
      one ``FenceRejectedError``, which the metric counts (``execute`` or ``raise_fence``).
      So adapter records - refused jobs no scrape covered <= metric <= adapter records
      (equal when every job that can hold a refusal, one ending ``lease_lost`` or
      ``restore_refused``, was scraped after it ended), and metric >= the zombies'
      refused writes that a scrape covered;
    * stale commits: the metric counts every commit Redis' fence refused (lease lost,
      generation mismatch, stale state); the drill logs the zombies' ones. Without a
      rollback every such refusal is a zombie's: the zombies' covered refusals <= metric
      <= the zombies' refusals (equal when all were scraped); a rollback can make a live
      worker's commit stale too (its
      lease went back with Redis), so then the zombies' covered refusals <= metric <= the
      zombies' refusals + the jobs that held a lease across the rollback and ended
      ``lease_lost`` (a refused commit ends its job so);
    * takeovers: the metric counts acquires of an expired lease that still names an owner.
      Every such acquire logs ``acquire`` at lease version >= 2, so metric <= those; and
      every lease whose holder a ``kill`` or ``pause`` fault stopped, taken by the next
      lease version (before a zombie was resumed), is one, so metric >= those;
    * leases acquired: metric between the ``acquire`` events covered by a scrape and all
      ``acquire`` events of the scraped workers.

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
    refusal_tail: set[int] = set()  # ... a refusal (its job then ends lease_lost or refused)
    unscraped_jobs = 0  # jobs that may hold a refusal no scrape saw (one at most each)
    for event in events:
        pid = int(event["pid"])
        if pid not in watch.workers or _covered(event, watch):
            continue
        tail.add(pid)
        if event.get("kind") == "job_end" and event.get("outcome") in _REFUSED_JOBS:
            refusal_tail.add(pid)
            unscraped_jobs += 1

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
    acquires = [e for e in evidence.events.get("acquire", []) if int(e["pid"]) in scraped]
    upper_takeovers = sum(1 for e in acquires if int(e.get("previous_lease_version") or 0) > 0)
    lower_takeovers = _lower_takeovers(record, evidence, watch)
    covered_acquires = sum(1 for e in acquires if _covered(e, watch))
    covered_commits = sum(1 for c in zombie_commits if _covered(c, watch))
    covered_writes = sum(1 for w in zombie_writes if _covered(w, watch))
    exact = unscraped_jobs == 0

    problems: list[str] = []
    low_writes = max(covered_writes, adapter_refusals - unscraped_jobs)
    if not low_writes <= writes <= adapter_refusals:
        problems.append(
            f"stale adapter writes {writes} not within [{low_writes}, "
            f"{adapter_refusals}]: {adapter_refusals} adapter refusals, "
            f"{unscraped_jobs} refused jobs unscraped, {covered_writes} zombie "
            "refusals scraped"
        )
    spanning = _jobs_across_rollback(record, evidence)
    if not covered_commits <= commits <= len(zombie_commits) + spanning:
        problems.append(
            f"stale commits {commits} not within [{covered_commits} zombie "
            f"refusals scraped, {len(zombie_commits)} zombie refusals + "
            f"{spanning} jobs cut off by the rollback]"
        )
    if not lower_takeovers <= takeovers <= upper_takeovers:
        problems.append(
            f"takeovers {takeovers} not within [{lower_takeovers} leases lost "
            f"to kill/pause, {upper_takeovers} acquires at lease version >= 2]"
        )
    if not covered_acquires <= acquired <= len(acquires):
        problems.append(
            f"leases acquired {acquired} not within [{covered_acquires}, "
            f"{len(acquires)}] acquire events"
        )

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
