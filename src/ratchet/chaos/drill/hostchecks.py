"""The multi-host drill's checker: evidence from where things happened, invariants, report.

Effects are counted where they happen: each workspace journal's committed writes by key,
read from the disk of the run's host (the journal is opened through the adapter first,
so a write a killed worker left half-done is settled), and the orders service's orders by
key, in the run's tenant. Who touched a run comes from the event log of each host (a
worker's events are in its host's folder); what the store says from the runs' verified
checkpoints and their incidents. Each invariant is pass, fail or unknown (nothing
happened that could show it), with its evidence.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.chaos.drill.hostplan import HostDrillRecord
from ratchet.chaos.drill.hostproc import workspace_name
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.services import NOTE
from ratchet.errors import RatchetError
from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run

__all__ = [
    "FOREIGN_OUTCOMES",
    "HostEvidence",
    "RunEvidence",
    "TaskEffects",
    "gather_hosts",
    "judge",
    "kills_by_host",
]

#: How a job of another host's run may end on a worker: handed on, held by someone else,
#: already ended, gone, or refused on the store's epoch. Anything else opened the run.
FOREIGN_OUTCOMES = frozenset({"routed", "held_elsewhere", "terminal", "no_run"})
_OPENED = frozenset({"restore", "ack", "stale_commit", "stale_write"})


@dataclass
class RunEvidence:
    phase: str = "unknown"
    document_host: str | None = None
    executed: set[str] = field(default_factory=set)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    rebaselines: int = 0
    kind: str = "workspace"  # the signed environment's kind: workspace or git
    remote: dict[str, str] = field(default_factory=dict)  # git: url, branch, base (signed)
    #: git: the writes the run recorded on its branch, in order (key, commit, sha256, path)
    git_writes: list[dict[str, str]] = field(default_factory=list)
    executed_base: int = 0  # writes no longer listed one by one (not countable)


@dataclass
class TaskEffects:
    """One task's effects where they happened: its journal's committed writes and its
    tenant's orders, by idempotency key."""

    journal: Counter[str] = field(default_factory=Counter)  # key -> committed writes
    orders: Counter[str] = field(default_factory=Counter)  # key -> orders
    unresolved: int = 0
    journal_check: str = ""
    note: str | None = None


def _journal(root: Path, into: TaskEffects) -> None:
    if not root.is_dir():
        return
    with contextlib.suppress(RatchetError), WorkspaceAdapter(root, [NOTE], busy_timeout_s=5.0):
        pass  # opening it settles a write a killed worker left half-done
    db = sqlite3.connect(f"file:{root / '.ratchet' / 'journal.sqlite3'}?mode=ro", uri=True)
    try:
        for key, status in db.execute("SELECT idempotency_key, status FROM writes"):
            if status == "committed":
                into.journal[str(key)] += 1
            elif status == "intent":
                into.unresolved += 1
        into.journal_check = "; ".join(str(r[0]) for r in db.execute("PRAGMA quick_check"))
    finally:
        db.close()
    with contextlib.suppress(OSError, UnicodeDecodeError):
        into.note = (root / NOTE).read_text()


def _orders(path: Path, into: TaskEffects) -> None:
    if not path.exists():
        return
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        for (key,) in db.execute("SELECT idempotency_key FROM orders"):
            into.orders[str(key)] += 1
        into.unresolved += int(
            db.execute("SELECT count(*) FROM requests WHERE status = 'in_flight'").fetchone()[0]
        )
    finally:
        db.close()


def _events(record: HostDrillRecord) -> list[dict[str, Any]]:
    """Every worker event, each with the host of the worker that wrote it."""
    out: list[dict[str, Any]] = []
    for host in record.hosts:
        for path in sorted((record.folder / "events" / host).glob("events-*.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        out.append({**event, "host": host})
    return out


def _run(fleet: Fleet, run_id: str) -> RunEvidence:
    try:
        view = inspect_run(fleet, run_id)
    except RatchetError:
        return RunEvidence()
    env = view.document.environment
    remote = env.remote
    writes = [
        {
            "key": e.idempotency_key,
            "commit": str(e.receipt.result.get("commit", "")),
            "sha256": str(e.receipt.result.get("sha256", "")),
            "path": str(e.receipt.result.get("path", "")),
        }
        for e in view.state.executed
        if e.receipt.namespace == "git"
    ]
    return RunEvidence(
        view.state.phase.value,
        env.host,
        {e.idempotency_key for e in view.state.executed if e.idempotency_key},
        view.incidents,
        len(view.state.rebaselines),
        env.kind,
        {"url": remote.url, "branch": remote.branch or "", "base": remote.base}
        if remote is not None
        else {},
        writes,
        view.state.executed_base,
    )


def _status(bad: list[str], evidence: int) -> str:
    return "fail" if bad else ("pass" if evidence else "unknown")


def _inv(name: str, bad: list[str], evidence: int, ok: str) -> Invariant:
    detail = "; ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
    return Invariant(name, _status(bad, evidence), detail or ok, evidence)


@dataclass
class HostEvidence:
    """What the drill left: every worker event (with its host), each run's verified
    state, and the effects of each task (by index), where they happened."""

    events: list[dict[str, Any]]
    runs: dict[str, RunEvidence]
    effects: dict[int, TaskEffects]


def gather_hosts(record: HostDrillRecord, fleet: Fleet) -> HostEvidence:
    """Read every record the drill left (the store must be up)."""
    effects: dict[int, TaskEffects] = {}
    for info in record.runs.values():
        if info.index not in effects:
            found = effects[info.index] = TaskEffects()
            _journal(record.host_backing(info.host) / workspace_name(info.index), found)
            _orders(record.folder / "orders" / f"t{info.index}.sqlite3", found)
    return HostEvidence(_events(record), {r: _run(fleet, r) for r in record.runs}, effects)


def judge(record: HostDrillRecord, evidence: HostEvidence) -> list[Invariant]:
    """Every invariant of the multi-host drill, judged on ``evidence``."""
    events, runs, effects = evidence.events, evidence.runs, evidence.effects
    cancelled = {str(c["run_id"]) for c in record.cancels}
    return [
        _own_host(record, runs, events, cancelled),
        _exactly_once(record, runs, effects),
        _after_return(record, runs, events),
        _untouched(record, runs, events),
        _routed_record_nothing(record, runs, events),
        _operators(record, runs, events),
        _inv(
            "no_run_frozen",
            [f"{r} ended {s} ({p})" for r, (s, p) in record.final.items() if s != "terminal"],
            len(record.final),
            f"all {len(record.final)} runs ended",
        ),
        _fired(record),
    ]


def _own_host(
    record: HostDrillRecord,
    runs: dict[str, RunEvidence],
    events: list[dict[str, Any]],
    cancelled: set[str],
) -> Invariant:
    bad: list[str] = []
    first = sum(1 for info in record.runs.values() if info.again_of is None)
    if first < record.options.runs:
        bad.append(f"{record.options.runs - first} runs never submitted (out of time)")
    for run_id, info in record.runs.items():
        ev = runs[run_id]
        if not (ev.document_host == info.host == info.submitted_host):
            bad.append(f"{run_id}: signed host {ev.document_host}, submitted on {info.host}")
        wanted = {"completed", "cancelled"} if run_id in cancelled else {"completed"}
        if ev.phase not in wanted:
            bad.append(f"{run_id} is {ev.phase}")
        for host in record.hosts:
            there = (record.host_backing(host) / workspace_name(info.index)).exists()
            if there != (host == info.host):
                bad.append(f"{run_id}: workspace {'on' if there else 'missing from'} {host}")
    for event in events:
        seen = record.runs.get(str(event.get("run_id")))
        if seen is not None and event["host"] != seen.host and event.get("kind") in _OPENED:
            bad.append(f"{seen.run_id}: {event['kind']} by a worker of {event['host']}")
    return _inv(
        "runs_complete_on_their_own_host", bad, len(record.runs), "every run ended on its host"
    )


def _exactly_once(
    record: HostDrillRecord, runs: dict[str, RunEvidence], effects: dict[int, TaskEffects]
) -> Invariant:
    bad: list[str] = []
    for index, found in sorted(effects.items()):
        mine = [r for r, i in record.runs.items() if i.index == index]
        recorded = set().union(*(runs[r].executed for r in mine))
        for where, counts in (("journal", found.journal), ("orders", found.orders)):
            for key, count in counts.items():
                if count > 1:
                    bad.append(f"t{index}: {count} effects for key {key} in the {where}")
                if key not in recorded:
                    bad.append(f"t{index}: an effect in the {where} no run recorded ({key})")
        if found.unresolved:
            bad.append(f"t{index}: {found.unresolved} writes or requests left unresolved")
        if found.journal_check and found.journal_check != "ok":
            bad.append(f"t{index}: journal check {found.journal_check}")
        for run_id in mine:
            if runs[run_id].phase != "completed":
                continue
            keys = runs[run_id].executed
            writes = sum(found.journal[k] for k in keys)
            orders = sum(found.orders[k] for k in keys)
            if (writes, orders) != (2, 1):
                bad.append(f"{run_id} completed with {writes} file writes and {orders} orders")
    return _inv("each_effect_exactly_once", bad, len(effects), "no effect doubled or unrecorded")


def _between(event: dict[str, Any], start: float, end: float) -> bool:
    return start <= float(event.get("at", 0)) <= end


def _after_return(
    record: HostDrillRecord, runs: dict[str, RunEvidence], events: list[dict[str, Any]]
) -> Invariant:
    bad: list[str] = []
    judged = 0
    for loss in record.losses:
        if "returned_at" not in loss or "runs" not in loss:
            continue
        lost, back = float(loss["lost_at"]), float(loss["returned_at"])
        before = loss.get("generations_before_return", {})
        for run_id, snap in loss["runs"].items():
            judged += 1
            if runs[run_id].phase not in ("completed", "cancelled"):
                bad.append(f"{run_id} ({loss['host']}) is {runs[run_id].phase}")
            ended = record.terminal_at.get(run_id)
            if ended is not None and ended < back:
                bad.append(f"{run_id} ended while {loss['host']} was gone")
            if snap.get("generation") != before.get(run_id):
                bad.append(
                    f"{run_id}: generation {snap.get('generation')} -> {before.get(run_id)} "
                    "while its host was gone"
                )
            for event in events:
                opened = event.get("run_id") == run_id and event.get("kind") in _OPENED
                if opened and _between(event, lost, back):
                    bad.append(f"{run_id}: {event['kind']} on {event['host']} while gone")
    return _inv(
        "lost_hosts_runs_complete_after_return",
        bad,
        judged,
        f"{judged} runs of lost hosts waited and ended after their host came back",
    )


def _untouched(
    record: HostDrillRecord, runs: dict[str, RunEvidence], events: list[dict[str, Any]]
) -> Invariant:
    bad: list[str] = []
    judged = 0
    for event in events:
        info = record.runs.get(str(event.get("run_id")))
        if info is None or event["host"] == info.host or event.get("kind") != "job_end":
            continue
        if event.get("outcome") not in FOREIGN_OUTCOMES:
            bad.append(f"{info.run_id}: a job on {event['host']} ended {event.get('outcome')}")
    for run_id, ev in runs.items():
        for incident in ev.incidents:
            text = json.dumps(incident)
            if incident.get("kind") == "restore_refused" and "not a directory" in text:
                bad.append(f"{run_id}: restore refused on a missing workspace")
    routed = _routed_leases(events)
    for loss in record.losses:
        if "gone_seen_at" not in loss:
            if "lost_at" in loss:
                bad.append(f"{loss['host']} was never seen gone")
            continue
        start, end = int(loss["lost_at_ms"]), int(loss.get("returned_at_ms", 2**62))
        waiting = loss.get("waiting_seen", {})
        for run_id in loss.get("runs", {}):
            judged += 1
            if run_id not in waiting:
                bad.append(f"{run_id}: never shown waiting for {loss['host']}")
            for incident in runs[run_id].incidents:
                at = int(incident.get("at_ms", 0))
                mine = (run_id, incident.get("lease_version")) in routed  # judged apart
                if start <= at <= end and incident.get("kind") != "operator_retry" and not mine:
                    bad.append(f"{run_id}: incident {incident.get('kind')} while its host was gone")
    return _inv(
        "gone_hosts_runs_untouched_elsewhere",
        bad,
        judged,
        f"{judged} runs of gone hosts shown waiting, opened by no other host",
    )


def _routed_leases(events: list[dict[str, Any]]) -> dict[tuple[str, Any], str]:
    """(run, lease version) of every job that handed its run on, with the routing host."""
    return {
        (str(e.get("run_id")), e.get("lease_version")): str(e["host"])
        for e in events
        if e.get("kind") == "job_end" and e.get("outcome") == "routed"
    }


def _routed_record_nothing(
    record: HostDrillRecord, runs: dict[str, RunEvidence], events: list[dict[str, Any]]
) -> Invariant:
    """A job that hands its run on to the run's host records nothing against it
    (docs/hosts.md): no incident under the lease that job took."""
    routed = _routed_leases(events)
    bad = [
        f"{run_id}: {incident.get('kind')} recorded under lease {incident.get('lease_version')} "
        f"by a worker of {routed[(run_id, incident.get('lease_version'))]} that handed the "
        f"run on to {record.runs[run_id].host}"
        for run_id, ev in runs.items()
        for incident in ev.incidents
        if (run_id, incident.get("lease_version")) in routed
    ]
    return _inv(
        "routed_jobs_record_nothing",
        bad,
        len(routed),
        f"{len(routed)} jobs handed their run on, recording nothing against it",
    )


def _operators(
    record: HostDrillRecord, runs: dict[str, RunEvidence], events: list[dict[str, Any]]
) -> Invariant:
    bad: list[str] = []
    judged = 0
    for loss in record.losses:
        retry = loss.get("retry")
        if retry is not None:
            judged += 1
            result = next((c for c in loss.get("commands", []) if c["what"] == "retry"), None)
            run_id = str(retry["run_id"])
            if result is None or result["exit"] != 0:
                bad.append(f"retry of {run_id}: {result and result['stderr'][-200:]}")
            if not any(i.get("kind") == "operator_retry" for i in runs[run_id].incidents):
                bad.append(f"retry of {run_id} left no operator_retry record")
        rebase = loss.get("rebaseline")
        if rebase is not None:
            judged += 1
            run_id = str(rebase["run_id"])
            wrong, own = rebase.get("wrong_host") or {}, rebase.get("own_host") or {}
            if "froze_at" not in rebase:
                bad.append(f"{run_id}: its changed disk did not freeze it ({rebase})")
            elif wrong.get("exit") in (0, None) or own.get("exit") != 0:
                bad.append(
                    f"{run_id}: rebaseline from another host exit {wrong.get('exit')}, "
                    f"from its own host exit {own.get('exit')} {own.get('stderr', '')[-200:]}"
                )
            if runs[run_id].rebaselines != 1 or runs[run_id].phase != "completed":
                bad.append(
                    f"{run_id}: {runs[run_id].rebaselines} rebaselines, {runs[run_id].phase}"
                )
    for cancel in record.cancels:
        judged += 1
        run_id, result = str(cancel["run_id"]), cancel.get("command") or {}
        phase = runs[run_id].phase
        if result.get("exit") != 0 and not (phase == "completed" and "nothing" in str(result)):
            bad.append(f"cancel of {run_id}: exit {result.get('exit')}")
        again = f"{run_id}-again"
        if phase == "cancelled" and runs.get(again, RunEvidence()).phase != "completed":
            # Says which: never created (its submits failed: see the drill's errors), or
            # created and left in a phase.
            where = (
                f"left {runs[again].phase or 'unread'}"
                if again in runs
                else "never created: " + "; ".join(e for e in record.errors if again in e)[-300:]
            )
            bad.append(f"{run_id} cancelled, its task submitted again is not completed ({where})")
    for misroute in [
        *record.misroutes,
        *(m for ls in record.losses for m in ls.get("misroutes", [])),
    ]:
        judged += 1
        info = record.runs[str(misroute["run_id"])]
        foreign = [
            e
            for e in events
            if e.get("run_id") == info.run_id
            and e["host"] != info.host
            and e.get("kind") == "job_end"
            and float(e.get("at", 0)) >= float(misroute["at"])
        ]
        if misroute["queue_host"] is not None and not foreign:
            bad.append(f"{info.run_id} put on {misroute['queue_host']}'s queue: no job ended there")
    return _inv(
        "operator_paths_no_double_effect",
        bad,
        judged,
        f"{judged} operator moves (retry, cancel then submit again, rebaseline, misroute) "
        "ended as they should, each effect once (each_effect_exactly_once)",
    )


def kills_by_host(record: HostDrillRecord) -> dict[str, int]:
    """Workers SIGKILLed at a failpoint, by host."""
    return {
        h: sum(1 for f in record.fired.get(h, []) if f.get("action") == "kill")
        for h in record.hosts
    }


def _fired(record: HostDrillRecord) -> Invariant:
    faults = record.options.faults
    kills = {
        h: sum(1 for f in record.fired.get(h, []) if f.get("action") == "kill")
        for h in record.hosts
    }
    losses = [ls for ls in record.losses if "lost_at" in ls]
    fired = {
        "kill": all(kills.values()) and bool(kills),
        "host-loss": bool(losses),
        "host-return": any("returned_at" in ls for ls in losses),
        "cancel": any((c.get("command") or {}).get("exit") == 0 for c in record.cancels),
        "retry": any("retry" in ls for ls in losses),
        "rebaseline": any("own_host" in (ls.get("rebaseline") or {}) for ls in losses),
        "misroute": bool(record.misroutes) or any(ls.get("misroutes") for ls in losses),
    }
    missing = sorted(f for f in faults if not fired.get(f))
    skipped = [
        f"{key.removesuffix('_skipped')}: {ls[key]}"
        for ls in losses
        for key in ("rebaseline_skipped", "retry_skipped")
        if key in ls
    ]
    detail = f"never fired: {missing}" if missing else "every requested fault fired"
    if "kill" in missing:
        detail += f" (kills by host: {kills})"
    if skipped:
        detail += f"; skipped at a loss: {skipped}"
    for what, why in record.skipped.items():
        detail += f"; {what} skipped: {why}"
    for loss in record.losses:
        if "skipped" in loss:
            detail += f"; a loss of {loss['host']} skipped: {loss['skipped']}"
    return Invariant("every_fault_fired", "unknown" if missing else "pass", detail, len(faults))
