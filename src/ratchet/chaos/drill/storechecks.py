"""The invariants of the store faults (:mod:`ratchet.chaos.drill.storefaults`).

Each compares the drill's own records of a fault with the workers' evidence by identity
(which run, which lease version, which generation, which digest, which process), never
by counts that depend on timing. Times are used only to pick which acknowledgements a
fault could have put at stake; the check each one then passes is one every ack must pass
anyway (it is in Redis' history at its generation with its digest), so a generous window
can only add checks, never a false failure.

``unknown`` when the fault never fired, or fired with nothing at stake (a pause while no
lease was live); a skipped fault (no root for the tmpfs, ``DEBUG`` refused) is unknown
with the reason.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ratchet.chaos.drill.evidence import Evidence, RunFacts
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.plan import DrillRecord
from ratchet.chaos.drill.storefaults import REFUSAL_INCIDENTS

__all__ = [
    "accepted_after_takeover",
    "ack_lost",
    "corrupted_runs_frozen",
    "owner_collision_fenced",
    "redis_pause_fenced",
    "slow_store_acks_kept",
    "store_full_acks_kept",
    "wiped_store_ran_nothing",
]

_UNSETTLED = ("active", "unreadable")
_RAN = ("acquire", "restore", "ack", "stale_commit", "stale_write")


def _invariant(name: str, status: str, detail: str, injections: int) -> Invariant:
    return Invariant(name, status, detail, injections)


def _status(bad: int, evidence: int) -> str:
    if bad:
        return "fail"
    return "pass" if evidence else "unknown"


def _rewound(record: DrillRecord) -> set[str]:
    return set(record.rollback["rewound"]) if record.rollback else set()


def _rewound_across(record: DrillRecord, start: float, end: float) -> set[str]:
    """The runs the rollback rewound, when the stretch it threw away (from its cut second
    to the rollback itself) overlaps ``start``..``end``: what they acknowledged then was
    lost by design. A fault wholly before the cut or after the rollback is judged on
    every run."""
    rollback = record.rollback
    if not rollback:
        return set()
    done_at = float(rollback.get("at", float("inf")))
    if done_at < start or float(rollback["cut_s"]) - 1.0 > end:
        return set()
    return set(rollback["rewound"])


def ack_lost(ack: dict[str, Any], facts: RunFacts | None) -> bool:
    """The acknowledged commit is not in Redis' final state: the high-water mark is below
    it, or the history holds another checkpoint at its generation."""
    if facts is None:
        return True
    generation = int(ack["generation"])
    kept = {g: d for g, _, d in facts.history}.get(generation)
    return (
        facts.generation is None
        or facts.generation < generation
        or (kept is not None and kept != ack["digest"])
    )


def accepted_after_takeover(
    run_id: str, facts: RunFacts | None, evidence: Evidence, lease_version: int | None = None
) -> list[str]:
    """Commits accepted under a lease after a later lease had taken the run over.

    A restore under lease L' read the run at generation r (the high-water mark, read under
    L'); a commit under a lower lease L at a generation above r can only have been accepted
    after L' was granted: the fence let a stale holder through. Read from Redis' history
    and from the workers' acks; ``lease_version`` limits it to commits under that lease.
    Returns one description per such commit.
    """
    restores = [
        (int(e["lease_version"]), int(e["generation"]))
        for e in evidence.events.get("restore", [])
        if e.get("run_id") == run_id
    ]
    commits = {(g, v) for g, v, _ in (facts.history if facts else [])}
    commits |= {
        (int(a["generation"]), int(a["lease_version"]))
        for a in evidence.events.get("ack", [])
        if a.get("run_id") == run_id
    }
    out = []
    for generation, version in sorted(commits):
        if lease_version is not None and version != lease_version:
            continue
        if any(later > version and read < generation for later, read in restores):
            out.append(f"{run_id} g{generation} under lease {version}")
    return out


def _acks_between(evidence: Evidence, start: float, end: float) -> list[dict[str, Any]]:
    return [a for a in evidence.events.get("ack", []) if start <= float(a["at"]) <= end]


def _lost_acks(acks: list[dict[str, Any]], evidence: Evidence, skip: set[str]) -> list[str]:
    return [
        f"{a['run_id']} g{a['generation']}"
        for a in acks
        if a["run_id"] not in skip and ack_lost(a, evidence.runs.get(str(a["run_id"])))
    ]


def _unsettled(runs: list[str], evidence: Evidence, record: DrillRecord) -> list[str]:
    return sorted(
        r
        for r in runs
        if r in evidence.runs
        and r not in record.corrupted
        and evidence.runs[r].status in _UNSETTLED
    )


def redis_pause_fenced(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``redis_pause_fenced``: no commit accepted under a lease that expired while Redis
    was stopped once another lease had taken its run over (by run, lease version,
    generation), every ack under such a lease kept, and each of their runs settled."""
    name = "redis_pause_fenced"
    pauses = record.faults_of("redis-pause")
    if not pauses:
        return _invariant(name, "unknown", "Redis was never paused", 0)
    # A rollback after a pause may cut away what followed it: its runs are judged only
    # when the rollback came first.
    expired = [
        lease
        for p in pauses
        for lease in p.get("leases", [])
        if int(lease["expires_at_ms"]) <= int(p["resumed_ms"])
        and lease["run_id"] not in _rewound_across(record, p["at"], float("inf"))
    ]
    stale: list[str] = []
    lost: list[str] = []
    for lease in expired:
        run_id, version = str(lease["run_id"]), int(lease["lease_version"])
        facts = evidence.runs.get(run_id)
        stale += accepted_after_takeover(run_id, facts, evidence, version)
        acks = [
            a
            for a in evidence.events.get("ack", [])
            if a.get("run_id") == run_id and int(a["lease_version"]) == version
        ]
        lost += _lost_acks(acks, evidence, set())
    unsettled = _unsettled(sorted({str(e["run_id"]) for e in expired}), evidence, record)
    bad = len(stale) + len(lost) + len(unsettled)
    return _invariant(
        name,
        _status(bad, len(expired)),
        f"{len(pauses)} pauses, {len(expired)} leases expired during one; "
        f"{len(stale)} commits accepted after a takeover {stale[:3]}, {len(lost)} acks under "
        f"them lost {lost[:3]}, {len(unsettled)} of their runs unsettled {unsettled[:3]}",
        len(pauses),
    )


def slow_store_acks_kept(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``slow_store_acks_kept``: every commit a worker acknowledged while Redis was slowed
    (``DEBUG SLEEP``) is in the final history at its generation with its digest."""
    name = "slow_store_acks_kept"
    slows = [f for f in record.faults_of("redis-slow") if f.get("sleeps")]
    if not slows:
        why = record.store_skipped.get("redis-slow", "Redis was never slowed")
        return _invariant(name, "unknown", why, 0)
    acks = [a for f in slows for a in _acks_between(evidence, f["at"], f["ended_at"] + 2.0)]
    rewound = {r for f in slows for r in _rewound_across(record, f["at"], f["ended_at"] + 2.0)}
    lost = _lost_acks(acks, evidence, rewound)
    sleeps = sum(int(f["sleeps"]) for f in slows)
    return _invariant(
        name,
        _status(len(lost), len(acks)),
        f"{sleeps} DEBUG SLEEPs; {len(acks)} commits acknowledged meanwhile, {len(lost)} "
        f"lost {lost[:3]}",
        sleeps,
    )


def store_full_acks_kept(record: DrillRecord, evidence: Evidence, kind: str) -> Invariant:
    """``oom_no_ack_lost`` / ``disk_full_no_ack_lost``: Redis refused writes (the drill's
    probe saw ``OOM`` / ``MISCONF``); no commit was acknowledged then that the final
    history lacks (a refusal taken for success), Redis accepted writes again after, and
    every run in flight at the fault settled."""
    name = "oom_no_ack_lost" if kind == "maxmemory" else "disk_full_no_ack_lost"
    faults = record.faults_of(kind)
    if kind in record.store_skipped and not faults:
        return _invariant(name, "unknown", f"skipped: {record.store_skipped[kind]}", 0)
    refused = [f for f in faults if f.get("refused")]
    if not refused:
        return _invariant(
            name, "unknown", f"{len(faults)} injections, Redis never refused a write", 0
        )
    acks = [a for f in refused for a in _acks_between(evidence, f["at"], f["ended_at"] + 1.0)]
    rewound = {r for f in refused for r in _rewound_across(record, f["at"], f["ended_at"] + 1.0)}
    lost = _lost_acks(acks, evidence, rewound)
    unrecovered = [f["kind"] for f in refused if f.get("aof_ok") is False]
    unsettled = _unsettled(
        sorted({r for f in refused for r in f.get("unsettled", [])}), evidence, record
    )
    bad = len(lost) + len(unrecovered) + len(unsettled)
    answers = sorted({str(f["refused"]).split(" ")[0] for f in refused})
    return _invariant(
        name,
        _status(bad, len(refused)),
        f"Redis refused writes ({', '.join(answers)}) {len(refused)} times; {len(acks)} "
        f"commits acknowledged around it, {len(lost)} lost {lost[:3]}; "
        f"{len(unrecovered)} times Redis did not write its AOF again; {len(unsettled)} runs "
        f"unsettled {unsettled[:3]}",
        len(refused),
    )


def _refusal_evidence(run_id: str, c: dict[str, Any], evidence: Evidence) -> list[str]:
    since, version = int(c["at_ms"]), int(c["lease_version"])
    facts = evidence.runs.get(run_id)
    found = [
        str(i.get("kind"))
        for i in (facts.incidents if facts else [])
        if i.get("kind") in REFUSAL_INCIDENTS and int(i.get("at_ms") or 0) >= since
    ]
    if c.get("refusal"):
        found.append(str(c["refusal"].get("kind")))
    found += [
        f"job_end:{e['outcome']}"
        for e in evidence.events.get("job_end", [])
        if e.get("run_id") == run_id
        and e.get("outcome") in ("restore_refused", "store_refused")
        and (e.get("lease_version") is None or int(e["lease_version"]) > version)
    ]
    return found


def corrupted_runs_frozen(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``corrupted_runs_frozen``: a corrupted run never ran again (no restore, ack or
    stale attempt under a lease granted after the corruption, no adapter effect added),
    a worker's refusal is on record for it (an incident since the corruption or a refused
    job), and every run that was not corrupted settled."""
    name = "corrupted_runs_frozen"
    corrupted = record.corrupted
    if not corrupted:
        return _invariant(name, "unknown", "no record was corrupted", 0)
    ran: list[str] = []
    effects: list[str] = []
    unproven: list[str] = []
    for run_id, c in sorted(corrupted.items()):
        version = int(c["lease_version"])
        ran += [
            f"{run_id}:{e['kind']}@{e['lease_version']}"
            for kind in ("restore", "ack", "stale_commit", "stale_write")
            for e in evidence.events.get(kind, [])
            if e.get("run_id") == run_id and int(e.get("lease_version") or 0) > version
        ]
        facts = evidence.runs.get(run_id)
        before = c.get("effects", {})
        if facts is not None and (
            sum(facts.adapters.file_effects.values()) > int(before.get("workspace", 0))
            or sum(facts.adapters.order_effects.values()) > int(before.get("orders", 0))
        ):
            effects.append(run_id)
        if not _refusal_evidence(run_id, c, evidence):
            unproven.append(run_id)
    others = _unsettled(sorted(set(evidence.runs) - set(corrupted)), evidence, record)
    bad = len(ran) + len(effects) + len(unproven) + len(others)
    kinds = sorted({str(c["how"]) for c in corrupted.values()})
    return _invariant(
        name,
        _status(bad, len(corrupted)),
        f"{len(corrupted)} runs corrupted ({', '.join(kinds)}); {len(ran)} ran again "
        f"{ran[:3]}, {len(effects)} gained an adapter effect {effects[:3]}, {len(unproven)} "
        f"without a recorded refusal {unproven[:3]}; {len(others)} other runs unsettled "
        f"{others[:3]}",
        len(corrupted),
    )


def _epoch_log_lines(folder: Path) -> int:
    lines = 0
    for path in sorted((folder / "logs").glob("worker-*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        lines += sum(
            1
            for line in text.splitlines()
            if "store epoch check failed" in line or "StoreEpochError" in line
        )
    return lines


def wiped_store_ran_nothing(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``wiped_store_ran_nothing``: after Redis came back empty, no worker acquired,
    restored, committed or wrote anything for a run created before (events, the fresh
    store's keys, the adapters' records before and after), and the workers reported the
    missing epoch (a job refused ``store_epoch_changed``, or the log says so)."""
    name = "wiped_store_ran_nothing"
    wipe = record.wipe
    if wipe is None:
        return _invariant(name, "unknown", "the store was never wiped", 0)
    at = float(wipe["at"])
    old = set(record.runs)
    ran = [
        f"{e['run_id']}:{kind}"
        for kind in _RAN
        for e in evidence.events.get(kind, [])
        if float(e["at"]) > at and e.get("run_id") in old
    ]
    keys = list(wipe.get("run_keys", []))
    before, after = wipe.get("effects_before", {}), wipe.get("effects_after", {})
    effects = sorted(r for r in before if after.get(r) != before[r])
    refusals = [
        e
        for e in evidence.events.get("job_end", [])
        if float(e["at"]) > at and e.get("outcome") == "store_epoch_changed"
    ]
    logged = _epoch_log_lines(record.folder)
    unreported = 1 if int(wipe.get("enqueued", 0)) and not (refusals or logged) else 0
    bad = len(ran) + len(keys) + len(effects) + unreported
    return _invariant(
        name,
        _status(bad, int(wipe.get("enqueued", 0))),
        f"{wipe.get('enqueued', 0)} old runs enqueued on the wiped store; {len(refusals)} jobs "
        f"refused it (store_epoch_changed), {logged} log lines on the epoch; {len(ran)} "
        f"worker events on it {ran[:3]}, {len(keys)} run keys in it {keys[:3]}, "
        f"{len(effects)} runs with a new adapter effect {effects[:3]}"
        + ("; no worker reported the missing epoch" if unreported else "")
        + ("" if wipe.get("quiet", True) else "; the fleet was not quiet at the wipe"),
        1,
    )


def fenced_stale_writes(record: DrillRecord, evidence: Evidence) -> list[dict[str, Any]]:
    """The stale writes an adapter accepted although a newer lease of their run had
    restored before they were sent (a restore raises the new lease's fence at every
    adapter before anything else). A zombie's write is sent when it resumes; one sent
    while no newer lease had restored yet (its takeovers gave up before reaching the
    adapters) meets no newer fence, and its effect is judged by one_effect_per_intent."""
    restores = evidence.events.get("restore", [])
    out = []
    for write in evidence.events.get("stale_write", []):
        if write.get("outcome") != "accepted":
            continue
        run_id, version, at = write["run_id"], int(write["lease_version"]), float(write["at"])
        resumed = [
            float(p["resumed_at"])
            for p in record.pauses
            if int(p["pid"]) == int(write["pid"])
            and p.get("resumed_at") is not None
            and float(p["resumed_at"]) <= at
        ]
        sent = max(resumed, default=at)
        if any(
            r["run_id"] == run_id and int(r["lease_version"]) > version and float(r["at"]) < sent
            for r in restores
        ):
            out.append(write)
    return out


def owner_collision_fenced(record: DrillRecord, evidence: Evidence) -> Invariant:
    """``owner_collision_fenced``: two workers started with one configured name still
    hold leases as distinct owners: no owner id is shared by two processes, no acquire
    entered a live lease another process held (the acquire script lets an owner id take
    its own live lease again), and no stale commit or write was accepted on their runs."""
    name = "owner_collision_fenced"
    twins = set(record.twins)
    if not twins:
        return _invariant(name, "unknown", "no workers were started with one name", 0)
    acquires = evidence.events.get("acquire", [])
    pids_of: dict[str, set[int]] = defaultdict(set)
    for e in acquires:
        pids_of[str(e.get("owner"))].add(int(e["pid"]))
    shared = sorted(o for o, pids in pids_of.items() if len(pids) > 1)
    entered = [
        f"{e['run_id']}@{e['lease_version']}"
        for e in acquires
        if not e.get("took_over")
        and e.get("previous_owner")
        and pids_of.get(str(e["previous_owner"]), set()) - {int(e["pid"])}
    ]
    active = {int(e["pid"]) for e in acquires if int(e["pid"]) in twins}
    touched = {str(e["run_id"]) for e in acquires if int(e["pid"]) in twins}
    stale = [
        r
        for r in sorted(touched)
        for e in evidence.events.get("stale_commit", [])
        if e.get("run_id") == r and e.get("outcome") == "accepted"
    ]
    stale += [w["run_id"] for w in fenced_stale_writes(record, evidence) if w["run_id"] in touched]
    stale += [
        r
        for r in sorted(touched)
        if r in evidence.runs and evidence.runs[r].adapters.lease_inversions
    ]
    stale += [s for r in sorted(touched) for s in _takeover_breaches(r, evidence, record)]
    bad = len(shared) + len(entered) + len(stale)
    return _invariant(
        name,
        _status(bad, 1 if len(active) >= 2 else 0),
        f"{len(twins)} workers with one name, {len(active)} took leases on {len(touched)} "
        f"runs; {len(shared)} owner ids shared by two processes, {len(entered)} live leases "
        f"entered by another process {entered[:3]}, {len(stale)} stale commits or writes "
        f"accepted {stale[:3]}",
        len(active),
    )


def _takeover_breaches(run_id: str, evidence: Evidence, record: DrillRecord) -> list[str]:
    if run_id in _rewound(record):
        return []
    return accepted_after_takeover(run_id, evidence.runs.get(run_id), evidence)
