"""The invariants of the drill's approvers and skewed clocks, judged by identity.

Every approval the drill signed is known by its nonce and digest (``record.humans``); the
orders service's own receipts name the approval each order was placed under
(``approval_digest``) and the second it was committed on the host's clock, which is the
store's (Redis runs on the drill's host); each run's final checkpoint names the nonces it
consumed and the approvals it took (``approval_refreshed`` trace events); the store's
global nonce record names the run that claimed each nonce. Nothing here counts events
whose number depends on timing: a verdict names the run, nonce or lease it is about.

* ``no_expired_approval_executed``: every order of a run that needed an approval was
  placed under an approval the drill signed for that run and that intent, committed no
  later than that approval's expiry on the store's clock; every run that needed one
  completed with exactly one such order, waits in ``awaiting_approval`` with its lease
  released, or was ended by another fault (cancelled, rewound, corrupted) with at most one;
* ``no_replayed_approval_accepted``: each nonce consumed by at most one run, once; no
  approval consumed by a run it was not signed for, or for an intent that is not the
  run's (stale); every replay posted through the checked path refused there;
* ``skewed_clocks_harmless``: the far-off worker exited 2 and never acquired a lease; no
  lease was taken over before it could have expired on Redis' clock (a takeover's lease
  version is Redis' time at the takeover, the lease it took over was acquired at its own
  version and lives at least one TTL), and no commit under a lease after the moment it
  was taken over; no approval signed by a skewed approver executed after its expiry.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from ratchet.chaos.drill.invariant import Invariant
from ratchet.errors import RatchetError
from ratchet.fleet.context import Fleet
from ratchet.leasing import run_keys
from ratchet.ops import inspect_run
from ratchet.runtime import TraceOutcome

__all__ = [
    "ApprovalRun",
    "HumanFacts",
    "approvals_fired",
    "gather_humans",
    "human_invariants",
    "no_expired_approval_executed",
    "no_replayed_approval_accepted",
    "skewed_clocks_harmless",
]

#: Runs ended by another fault: judged on their orders only, not on how they ended.
_ENDED_OTHERWISE = ("cancelled", "failed")


@dataclass
class ApprovalRun:
    """One run that needed an approval, as the stores left it."""

    run_id: str
    status: str
    phase: str
    consumed: list[str] = field(default_factory=list)  # nonces, as the checkpoint has them
    taken: list[str] = field(default_factory=list)  # approval digests the run took
    orders: list[tuple[str | None, int]] = field(default_factory=list)  # (digest, at s)
    lease_live: bool = False
    readable: bool = True


@dataclass
class HumanFacts:
    runs: dict[str, ApprovalRun] = field(default_factory=dict)
    holders: dict[str, str | None] = field(default_factory=dict)  # nonce -> claiming run
    # run -> (lease version, Redis ms) of every commit in its history
    commits: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


def _commit_times(fleet: Fleet, run_id: str) -> list[tuple[int, int]]:
    out = []
    for raw in fleet.store.client.lrange(run_keys(run_id).history, 0, -1):
        parts = raw.decode("utf-8", "replace").split("|")
        if len(parts) >= 7 and parts[2].isdigit() and parts[6].isdigit():
            out.append((int(parts[2]), int(parts[6])))
    return out


def _receipts(db_path: Path) -> list[tuple[str | None, int]]:
    if not db_path.exists():
        return []
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute(
            "SELECT r.receipt FROM orders o JOIN requests r USING (idempotency_key)"
        ).fetchall()
    finally:
        db.close()
    out: list[tuple[str | None, int]] = []
    for (raw,) in rows:
        receipt = json.loads(raw) if raw else {}
        digest = receipt.get("approval_digest")
        out.append((str(digest) if digest else None, int(receipt.get("committed_at", 0))))
    return out


def gather_humans(record: Any, fleet: Fleet) -> HumanFacts:
    """Read the approval runs' checkpoints, their orders and the store's nonce record."""
    facts = HumanFacts()
    log = record.humans or {}
    for run_id in log.get("approval_runs", []):
        index = record.runs.get(run_id)
        status, phase = record.final.get(run_id, ("unreadable", "unknown"))
        run = ApprovalRun(run_id, status, phase)
        if index is not None:
            run.orders = _receipts(record.folder / "orders" / f"t{index}.sqlite3")
        try:
            view = inspect_run(fleet, run_id)
            run.consumed = list(view.state.consumed_nonces)
            run.taken = [
                str(e.detail.get("approval_digest"))
                for e in view.state.trace
                if e.outcome is TraceOutcome.APPROVAL_REFRESHED
            ]
            run.lease_live = view.snapshot.lease_live
        except RatchetError:
            run.readable = False
        facts.runs[run_id] = run
    if log.get("skews"):
        for run_id in record.runs:
            try:
                facts.commits[run_id] = _commit_times(fleet, run_id)
            except RedisError:
                continue
    for entry in log.get("approvals", []):
        nonce = str(entry["nonce"])
        if nonce not in facts.holders:
            try:
                facts.holders[nonce] = fleet.store.nonce_claimed_by(nonce)
            except RatchetError:
                facts.holders[nonce] = None
    return facts


def _status(bad: int, evidence: int) -> str:
    if bad:
        return "fail"
    return "pass" if evidence else "unknown"


def approvals_fired(log: dict[str, Any]) -> dict[str, int]:
    """How often each human fault fired: approvals raced (short, stale, replayed or
    wrong-run ones posted) and clocks skewed (skewed workers started, the far-off one)."""
    raced = sum(1 for a in log.get("approvals", []) if a.get("kind") != "valid")
    return {"approvals": raced, "clock-skew": len(log.get("skews", {}))}


def _signed(log: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """digest -> the approval as signed (the first entry of each: replays repeat it)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in log.get("approvals", []):
        out.setdefault(str(entry["digest"]), entry)
    return out


def _order_problems(run: ApprovalRun, signed: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for digest, at in run.orders:
        entry = signed.get(digest or "")
        if entry is None:
            problems.append(f"{run.run_id}: an order under no approval the drill signed")
        elif entry["run"] != run.run_id or entry["kind"] == "stale":
            problems.append(f"{run.run_id}: an order under {entry['kind']} {entry['nonce']}")
        elif at > int(entry["expires_at"]):
            problems.append(
                f"{run.run_id}: order committed at {at} under {entry['nonce']} expired at "
                f"{entry['expires_at']} (store clock)"
            )
    return problems


def no_expired_approval_executed(record: Any, facts: HumanFacts) -> Invariant:
    log = record.humans or {}
    signed = _signed(log)
    problems: list[str] = []
    completed = waiting = 0
    for run in facts.runs.values():
        problems += _order_problems(run, signed)
        if run.run_id in record.corrupted or run.run_id in _rewound(record):
            continue
        if run.phase == "completed":
            completed += 1
            if len(run.orders) != 1:
                problems.append(f"{run.run_id}: completed with {len(run.orders)} orders")
        elif run.phase == "awaiting_approval" and not run.lease_live:
            waiting += 1
            if run.orders:
                problems.append(f"{run.run_id}: waits for approval with an order placed")
        elif run.phase in _ENDED_OTHERWISE:
            if len(run.orders) > 1:
                problems.append(f"{run.run_id}: {run.phase} with {len(run.orders)} orders")
        else:
            problems.append(f"{run.run_id}: ended {run.status}/{run.phase}")
    short = [a for a in log.get("approvals", []) if a.get("kind") == "short"]
    return Invariant(
        "no_expired_approval_executed",
        _status(len(problems), len(short) and len(facts.runs)),
        f"{len(facts.runs)} runs needed an approval: {completed} completed, {waiting} waiting; "
        f"{len(short)} short-lived approvals raced the write; {len(problems)} problems"
        + (f": {problems[:3]}" if problems else ""),
        len(short),
    )


def _rewound(record: Any) -> set[str]:
    rollback = getattr(record, "rollback", None) or {}
    return set(rollback.get("rewound", {}))


def no_replayed_approval_accepted(record: Any, facts: HumanFacts) -> Invariant:
    log = record.humans or {}
    entries = log.get("approvals", [])
    signed = _signed(log)
    problems: list[str] = []
    consumers: Counter[str] = Counter()
    for run in facts.runs.values():
        for nonce, times in Counter(run.consumed).items():
            consumers[nonce] += 1
            if times > 1:
                problems.append(f"{run.run_id} consumed {nonce} {times} times")
        for digest, times in Counter(run.taken).items():
            entry = signed.get(digest)
            if times > 1:
                problems.append(f"{run.run_id} took approval {digest[:12]} {times} times")
            if entry is not None and (entry["run"] != run.run_id or entry["kind"] == "stale"):
                problems.append(f"{run.run_id} took {entry['kind']} approval {entry['nonce']}")
    problems += [f"{n} consumed by {c} runs" for n, c in consumers.items() if c > 1]
    for entry in entries:
        nonce, target = str(entry["nonce"]), str(entry["target"])
        foreign = entry["run"] != target or entry["kind"] == "stale"
        if foreign:
            held = facts.runs.get(target)
            if (held is not None and nonce in held.consumed) or facts.holders.get(nonce) == target:
                problems.append(f"{entry['kind']} {nonce} consumed by {target}")
        if entry["kind"] in ("replay", "wrong_run") and entry.get("posted") == "checked":
            problems.append(f"{entry['kind']} {nonce} to {target} passed the checked post")
    raced = [e for e in entries if e["kind"] in ("replay", "wrong_run", "stale")]
    return Invariant(
        "no_replayed_approval_accepted",
        _status(len(problems), sum(1 for e in raced if e["kind"] != "stale")),
        f"{sum(1 for e in raced if e['kind'] == 'replay')} replays, "
        f"{sum(1 for e in raced if e['kind'] == 'wrong_run')} wrong-run and "
        f"{sum(1 for e in raced if e['kind'] == 'stale')} stale-intent approvals posted; "
        f"{len(problems)} accepted" + (f": {problems[:3]}" if problems else ""),
        len(raced),
    )


def _takeover_problems(record: Any, evidence: Any, facts: HumanFacts) -> tuple[int, list[str]]:
    """Takeovers judged on Redis' clock: (takeovers judged, problems)."""
    ttl_ms = int(record.options.ttl_ms)
    judged, problems = 0, []
    for event in evidence.events.get("acquire", []):
        if not event.get("took_over"):
            continue
        run_id, version = str(event["run_id"]), int(event["lease_version"])
        previous = int(event.get("previous_lease_version") or 0)
        if version <= previous + 1 or previous <= 0:
            continue  # a version not read off Redis' clock: nothing to judge by time
        judged += 1
        if version - previous < ttl_ms:
            problems.append(
                f"{run_id}: lease {previous} taken over {version - previous} ms after it was "
                f"acquired (TTL {ttl_ms} ms)"
            )
        late = [
            at for lease, at in facts.commits.get(run_id, []) if lease == previous and at > version
        ]
        if late:
            problems.append(f"{run_id}: a commit under lease {previous} after its takeover")
    return judged, problems


def skewed_clocks_harmless(record: Any, evidence: Any, facts: HumanFacts) -> Invariant:
    log = record.humans or {}
    skews = {int(p): float(s) for p, s in log.get("skews", {}).items()}
    far = log.get("far_off") or {}
    problems: list[str] = []
    far_pid = int(far["pid"]) if far else None
    if far_pid is not None:
        exits = [d.get("exitcode") for d in record.deaths if d.get("pid") == far_pid]
        if exits != [2]:
            problems.append(f"the worker {far.get('skew_s')} s off exited {exits or 'never'}")
        if any(int(e.get("pid", 0)) == far_pid for e in evidence.events.get("acquire", [])):
            problems.append("the worker far off acquired a lease")
    worked = {
        int(e["pid"])
        for e in evidence.events.get("acquire", [])
        if int(e.get("pid", 0)) in skews and int(e["pid"]) != far_pid
    }
    judged, late = _takeover_problems(record, evidence, facts)
    problems += late
    skewed_signers = {
        a["digest"] for a in log.get("approvals", []) if float(a.get("approver_skew_s", 0)) != 0
    }
    signed = _signed(log)
    executed_skewed = 0
    for run in facts.runs.values():
        for digest, at in run.orders:
            if digest is not None and digest in skewed_signers:
                executed_skewed += 1
                if at > int(signed[digest]["expires_at"]):
                    problems.append(f"{run.run_id}: a skewed approver's expired approval ran")
    seen = len(worked) + (1 if far_pid is not None else 0)
    return Invariant(
        "skewed_clocks_harmless",
        _status(len(problems), len(worked) and far_pid is not None),
        f"{len(worked)} skewed workers took leases, the far-off one "
        f"{'refused to start' if far_pid is not None and not problems else 'see problems'}; "
        f"{judged} takeovers judged on Redis' clock; {executed_skewed} orders under skewed "
        f"approvers' approvals; {len(problems)} problems"
        + (f": {problems[:3]}" if problems else ""),
        seen,
    )


def human_invariants(record: Any, evidence: Any) -> list[Invariant]:
    """The invariants of the human faults the drill was asked for."""
    wanted, facts = record.options.faults, evidence.humans
    out = []
    if "approvals" in wanted:
        out.append(no_expired_approval_executed(record, facts))
        out.append(no_replayed_approval_accepted(record, facts))
    if "clock-skew" in wanted:
        out.append(skewed_clocks_harmless(record, evidence, facts))
    return out
