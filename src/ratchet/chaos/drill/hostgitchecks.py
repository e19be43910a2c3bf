"""The git profile's checker: each run's commits counted on the remote, and its invariants.

Effects are counted where they happen: every run's branch is read on the remote, as a
worker reads it (:class:`ratchet.adapters.gitremote.RemoteBranch`, the first-parent chain
from the base commit the run's signed document names), its commits sorted into writes
(by their ``Ratchet-Key`` trailer), fence commits and anything else; the orders service's
orders by key, in the run's tenant, as the folder profile counts them. Who ran a run
comes from each host's event log; what the store says from the runs' verified
checkpoints. Each invariant is pass, fail or unknown (nothing happened that could show
it), with its evidence.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.adapters.gitremote import RemoteBranch
from ratchet.chaos.drill.hostchecks import (
    HostEvidence,
    RunEvidence,
    TaskEffects,
    gather_hosts,
    kills_by_host,
)
from ratchet.chaos.drill.hostgit import owner_host
from ratchet.chaos.drill.hostplan import HostDrillRecord
from ratchet.chaos.drill.invariant import Invariant
from ratchet.chaos.drill.services import NOTE, expected_note
from ratchet.errors import RatchetError
from ratchet.fleet.context import Fleet

__all__ = [
    "BranchEvidence",
    "GitEvidence",
    "cut_jobs",
    "gather_git",
    "git_figures",
    "judge_git",
    "read_branch",
]

#: A retry refused because the run had moved on: a worker holds it, or it ended.
_RETRY_RACED = ("holds the run", "nothing to retry")
#: Writes a completed drill run makes on its branch (the note, twice).
_GIT_WRITES = 2


@dataclass
class BranchEvidence:
    """One run's branch on the remote, read above its base commit."""

    branch: str = ""
    error: str = ""  # why it could not be read ("" when it was)
    keys: Counter[str] = field(default_factory=Counter)  # idempotency key -> commits
    commit_of: dict[str, str] = field(default_factory=dict)  # key -> its (first) commit
    tree_of: dict[str, str] = field(default_factory=dict)  # commit -> its tree
    fences: int = 0  # fence commits of the run
    foreign: list[str] = field(default_factory=list)  # commits neither a write nor a fence
    base_tree: str = ""
    tip_tree: str = ""
    note: str | None = None  # the note at the tip


def read_branch(run_id: str, remote: dict[str, str], cache: Path) -> BranchEvidence:
    """Read run ``run_id``'s branch as its signed document names it (url, branch, base)."""
    found = BranchEvidence(branch=remote.get("branch", ""))
    if not remote.get("url") or not found.branch or not remote.get("base"):
        found.error = "the run's signed document names no remote branch and base"
        return found
    branch = RemoteBranch(remote["url"], found.branch, cache=cache)
    try:
        tip = branch.tip()
        if tip is None:
            found.error = "the branch is missing from the remote"
            return found
        branch.fetch(tip)
        base = remote["base"].encode()
        found.base_tree = branch.commit(base).tree.decode()
        for entry in branch.history(tip, base):
            commit = entry.commit.decode()
            found.tree_of[commit] = entry.tree.decode()
            trailers = entry.trailers
            key = trailers.get("Ratchet-Key")
            if trailers.get("Ratchet-Run") != run_id:
                found.foreign.append(commit)
            elif entry.is_fence:
                found.fences += 1
            elif key is None:
                found.foreign.append(commit)
            else:
                found.keys[key] += 1
                found.commit_of.setdefault(key, commit)
        tree = branch.commit(tip).tree
        found.tip_tree = tree.decode()
        at = branch.path_at(tree, NOTE)
        if at is not None:
            found.note = branch.blob(at[1]).as_raw_string().decode(errors="replace")
    except (RatchetError, KeyError, ValueError) as exc:
        found.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        branch.close()
    return found


@dataclass
class GitEvidence(HostEvidence):
    """The folder profile's evidence (events, runs, the orders) and every run's branch."""

    branches: dict[str, BranchEvidence] = field(default_factory=dict)


def gather_git(record: HostDrillRecord, fleet: Fleet) -> GitEvidence:
    """Read every record the drill left and every run's branch (the store and the git
    server must be up)."""
    base = gather_hosts(record, fleet)
    cache = record.folder / "checker-git"
    branches = {r: read_branch(r, ev.remote, cache) for r, ev in base.runs.items()}
    return GitEvidence(base.events, base.runs, base.effects, branches)


def cut_jobs(record: HostDrillRecord, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Jobs that ended to be retried later because the git remote could not be reached,
    from a server kill (its time is taken once the group is dead: half a second before)
    until a second after its restart."""
    windows = [
        (
            max(float(k.get("armed_at", 0)), float(k["killed_at"]) - 0.5),
            float(k.get("restarted_at", 2.0**62)) + 1.0,
        )
        for k in record.server_kills
        if "killed_at" in k
    ]
    return [
        e
        for e in events
        if e.get("kind") == "job_end"
        and e.get("outcome") == "retry_later"
        and "git remote" in str(e.get("detail", ""))
        and any(a <= float(e.get("at", 0)) <= b for a, b in windows)
    ]


# -- the invariants -----------------------------------------------------------------------


def _verdict(bad: list[str], judged: int) -> str:
    return "fail" if bad else ("pass" if judged else "unknown")


def _detail(bad: list[str], ok: str) -> str:
    more = f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""
    return "; ".join(bad[:8]) + more if bad else ok


def judge_git(record: HostDrillRecord, evidence: GitEvidence) -> list[Invariant]:
    """Every invariant of the git profile, judged on ``evidence``."""
    events, runs = evidence.events, evidence.runs
    cancelled = {str(c["run_id"]) for c in record.cancels}
    return [
        _bound_to_no_host(record, runs, cancelled),
        _one_commit_per_write(record, runs, evidence.branches),
        _orders_once(record, runs, evidence.effects),
        _continue_elsewhere(record, runs, events),
        _server_kills(record, evidence.branches, len(cut_jobs(record, events))),
        _operators(record, runs),
        Invariant(
            "no_run_frozen",
            _verdict(
                bad := [
                    f"{r} ended {s} ({p})" for r, (s, p) in record.final.items() if s != "terminal"
                ],
                len(record.final),
            ),
            _detail(bad, f"all {len(record.final)} runs ended"),
            len(record.final),
        ),
        _fired(record),
    ]


def _bound_to_no_host(
    record: HostDrillRecord, runs: dict[str, RunEvidence], cancelled: set[str]
) -> Invariant:
    bad: list[str] = []
    first = sum(1 for info in record.runs.values() if info.again_of is None)
    if first < record.options.runs:
        bad.append(f"{record.options.runs - first} runs never submitted (out of time)")
    for run_id, info in record.runs.items():
        ev = runs[run_id]
        if ev.kind != "git" or ev.document_host is not None:
            bad.append(f"{run_id}: signed environment {ev.kind} bound to {ev.document_host}")
        if ev.remote.get("branch") != f"ratchet/{run_id}" or ev.remote.get("url") != (
            record.remote_url
        ):
            bad.append(f"{run_id}: signed remote {ev.remote}")
        if info.submitted_host != info.host:
            bad.append(
                f"{run_id}: submitted on {info.host}, its submitter said {info.submitted_host}"
            )
        wanted = {"completed", "cancelled"} if run_id in cancelled else {"completed"}
        if ev.phase not in wanted:
            bad.append(f"{run_id} is {ev.phase}")
    return Invariant(
        "runs_complete_bound_to_no_host",
        _verdict(bad, len(record.runs)),
        _detail(bad, f"{len(record.runs)} runs on their own branches, bound to no host, ended"),
        len(record.runs),
    )


def _one_commit_per_write(
    record: HostDrillRecord, runs: dict[str, RunEvidence], branches: dict[str, BranchEvidence]
) -> Invariant:
    bad: list[str] = []
    writes = 0
    for run_id, info in sorted(record.runs.items()):
        ev, branch = runs[run_id], branches.get(run_id, BranchEvidence(error="not read"))
        if branch.error:
            bad.append(f"{run_id}: branch {branch.branch or '?'} unreadable: {branch.error}")
            continue
        if ev.executed_base:
            bad.append(f"{run_id}: {ev.executed_base} writes no longer listed: not countable")
        recorded = [w["key"] for w in ev.git_writes]
        writes += len(recorded)
        for key in recorded:
            if branch.keys[key] != 1:
                bad.append(f"{run_id}: write {key} has {branch.keys[key]} commits")
        for key, count in branch.keys.items():
            if key not in recorded:
                # A cancel settles its pending write: recorded when found, and fenced off
                # for good when not, so no commit may carry a key the run did not record.
                bad.append(f"{run_id}: {count} commits carry key {key}, which it never recorded")
        if branch.foreign:
            bad.append(f"{run_id}: {len(branch.foreign)} commits neither a write nor a fence")
        for write in ev.git_writes:
            if branch.commit_of.get(write["key"]) not in (None, write["commit"]):
                bad.append(f"{run_id}: receipt of {write['key']} names another commit")
        if ev.git_writes:
            last = ev.git_writes[-1]
            if branch.tree_of.get(last["commit"]) != branch.tip_tree:
                bad.append(f"{run_id}: the branch's content is not its last write's")
        elif branch.tip_tree != branch.base_tree:
            bad.append(f"{run_id}: no write recorded, but the branch's content changed")
        if ev.phase == "completed":
            if len(recorded) != _GIT_WRITES:
                bad.append(f"{run_id} completed with {len(recorded)} commits recorded")
            if branch.note != expected_note(info.index):
                bad.append(f"{run_id} completed with note {branch.note!r}")
    return Invariant(
        "each_write_one_commit",
        _verdict(bad, len(record.runs)),
        _detail(
            bad,
            f"{writes} writes of {len(record.runs)} runs, each exactly one commit on its "
            "branch; no key twice, none unrecorded; every branch ends at its run's last write",
        ),
        writes,
    )


def _orders_once(
    record: HostDrillRecord, runs: dict[str, RunEvidence], effects: dict[int, TaskEffects]
) -> Invariant:
    bad: list[str] = []
    for index, found in sorted(effects.items()):
        mine = [r for r, i in record.runs.items() if i.index == index]
        recorded = set().union(*(runs[r].executed for r in mine))
        for key, count in found.orders.items():
            if count > 1:
                bad.append(f"t{index}: {count} orders for key {key}")
            if key not in recorded:
                bad.append(f"t{index}: an order no run recorded ({key})")
        if found.unresolved:
            bad.append(f"t{index}: {found.unresolved} requests left unresolved")
        for run_id in mine:
            if runs[run_id].phase == "completed":
                orders = sum(found.orders[k] for k in runs[run_id].executed)
                if orders != 1:
                    bad.append(f"{run_id} completed with {orders} orders")
    return Invariant(
        "orders_exactly_once",
        _verdict(bad, len(effects)),
        _detail(bad, "every order once, each recorded by its run"),
        len(effects),
    )


def _continue_elsewhere(
    record: HostDrillRecord, runs: dict[str, RunEvidence], events: list[dict[str, Any]]
) -> Invariant:
    bad: list[str] = []
    judged = 0
    empty: list[str] = []
    for loss in record.losses:
        if "lost_at" not in loss:
            continue
        host, lost = str(loss["host"]), float(loss["lost_at"])
        back = float(loss.get("returned_at", record.finished_at or 2.0**62))
        stranded = loss.get("runs", {})
        if not stranded:
            empty.append(host)
        for run_id in stranded:
            judged += 1
            if runs[run_id].phase not in ("completed", "cancelled"):
                bad.append(f"{run_id} ({host}) is {runs[run_id].phase}")
            ended = record.terminal_at.get(run_id)
            if ended is None or ended >= back:
                bad.append(f"{run_id} did not end while {host} was gone: it waited for it")
            mine = [e for e in events if e.get("run_id") == run_id]
            elsewhere = [
                e
                for e in mine
                if e["host"] != host
                and e.get("kind") in ("restore", "ack")
                and float(e.get("at", 0)) >= lost
            ]
            if not elsewhere:
                bad.append(
                    f"{run_id}: no worker of another host continued it after {host} was lost"
                )
            ghosts = [e for e in mine if e["host"] == host and lost < float(e.get("at", 0)) < back]
            if ghosts:
                bad.append(f"{run_id}: {ghosts[0].get('kind')} on {host} while it was gone")
    status = _verdict(bad, judged)
    if status == "pass" and empty:
        status = "unknown"
    ok = f"{judged} runs stranded by a host loss each ended on another host while it was gone"
    if empty:
        ok += f"; no run stranded by the loss of {', '.join(empty)}"
    return Invariant("lost_hosts_runs_continue_elsewhere", status, _detail(bad, ok), judged)


def _server_kills(
    record: HostDrillRecord, branches: dict[str, BranchEvidence], cut: int
) -> Invariant:
    bad: list[str] = []
    kills = [k for k in record.server_kills if "killed_at" in k]
    for kill in kills:
        if "restarted_at" not in kill:
            bad.append(f"the git server killed at {kill['killed_at']:.1f} was never restarted")
    if kills:
        for run_id, (status, phase) in sorted(record.final.items()):
            if status != "terminal":
                bad.append(f"{run_id} did not end ({status}, {phase})")
        for run_id, branch in sorted(branches.items()):
            doubled = sorted(k for k, n in branch.keys.items() if n > 1)
            if doubled:
                bad.append(f"{run_id}: keys committed twice {doubled}")
    pushes = sum(int(k.get("pushes_in_flight", 0)) for k in kills)
    return Invariant(
        "server_kill_no_double_commit",
        _verdict(bad, len(kills)),
        _detail(
            bad,
            f"{len(kills)} git server kills ({pushes} pushes in flight cut, {cut} jobs met "
            "the remote unreachable and were retried): restarted, every run ended, no key "
            "committed twice",
        ),
        len(kills),
    )


def _operators(record: HostDrillRecord, runs: dict[str, RunEvidence]) -> Invariant:
    bad: list[str] = []
    judged = 0
    for loss in record.losses:
        retry = loss.get("retry")
        if retry is None:
            continue
        judged += 1
        run_id = str(retry["run_id"])
        result = next((c for c in loss.get("commands", []) if c["what"] == "retry"), None)
        if result is None:
            bad.append(f"retry of {run_id} never ran")
        elif result["exit"] == 0:
            if not any(i.get("kind") == "operator_retry" for i in runs[run_id].incidents):
                bad.append(f"retry of {run_id} left no operator_retry record")
        elif not any(why in str(result.get("stderr", "")) for why in _RETRY_RACED):
            bad.append(f"retry of {run_id}: exit {result['exit']} {result['stderr'][-200:]}")
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
    return Invariant(
        "operator_paths_no_double_effect",
        _verdict(bad, judged),
        _detail(
            bad,
            f"{judged} operator moves (a retry racing the takeover, cancel then submit "
            "again) ended as they should, each write one commit (each_write_one_commit)",
        ),
        judged,
    )


def _fired(record: HostDrillRecord) -> Invariant:
    faults = record.options.faults
    kills = kills_by_host(record)
    losses = [ls for ls in record.losses if "lost_at" in ls]
    server = [k for k in record.server_kills if "killed_at" in k]
    fired = {
        "kill": bool(kills) and all(kills.values()),
        "host-loss": bool(losses),
        "host-return": any("returned_at" in ls for ls in losses),
        "cancel": any((c.get("command") or {}).get("exit") == 0 for c in record.cancels),
        "retry": any(c["what"] == "retry" for ls in losses for c in ls.get("commands", [])),
        "git-server-kill": any(int(k.get("pushes_in_flight", 0)) for k in server),
    }
    missing = sorted(f for f in faults if not fired.get(f))
    detail = f"never fired: {missing}" if missing else "every requested fault fired"
    if "kill" in missing:
        detail += f" (kills by host: {kills})"
    if "git-server-kill" in missing and server:
        detail += f" ({len(server)} server kills, none with a push in flight)"
    for what, why in record.skipped.items():
        detail += f"; {what} skipped: {why}"
    for loss in record.losses:
        for key in ("skipped", "retry_skipped"):
            if key in loss:
                detail += f"; at the loss of {loss['host']}: {loss[key]}"
    return Invariant("every_fault_fired", "unknown" if missing else "pass", detail, len(faults))


# -- the figures --------------------------------------------------------------------------


def _finisher(run_id: str, events: list[dict[str, Any]]) -> str | None:
    """The host of the worker whose commit of the run came last (its end)."""
    acks = [e for e in events if e.get("run_id") == run_id and e.get("kind") == "ack"]
    return str(max(acks, key=lambda e: float(e.get("at", 0)))["host"]) if acks else None


def git_figures(record: HostDrillRecord, evidence: GitEvidence) -> dict[str, Any]:
    """The git profile's figures: where runs were submitted and finished, takeovers
    across hosts, losses, server kills, and the commits per write counted on the remote."""
    events, runs, branches = evidence.events, evidence.runs, evidence.branches
    completed_on: Counter[str] = Counter()
    for run_id, ev in runs.items():
        if ev.phase == "completed":
            completed_on[_finisher(run_id, events) or "unknown"] += 1
    across = [
        e
        for e in events
        if e.get("kind") == "acquire"
        and e.get("took_over")
        and owner_host(str(e.get("previous_owner") or "")) not in (None, e["host"])
    ]
    per_write: Counter[int] = Counter()
    by_run: dict[str, list[int]] = {}
    for run_id, ev in sorted(runs.items()):
        branch = branches.get(run_id, BranchEvidence())
        by_run[run_id] = [branch.keys[w["key"]] for w in ev.git_writes]
        per_write.update(by_run[run_id])
    duplicate_commits = sum(max(0, n - 1) for b in branches.values() for n in b.keys.values())
    duplicate_orders = sum(
        max(0, n - 1) for e in evidence.effects.values() for n in e.orders.values()
    )
    after: list[float] = []
    per_loss = []
    for loss in record.losses:
        if "lost_at" not in loss:
            continue
        lost, back = float(loss["lost_at"]), float(loss.get("returned_at", 2.0**62))
        stranded = list(loss.get("runs", {}))
        times = [record.terminal_at[r] - lost for r in stranded if r in record.terminal_at]
        after += times
        per_loss.append(
            {
                "host": loss["host"],
                "runs_stranded": len(stranded),
                "taken_elsewhere": len(loss.get("taken_elsewhere", {})),
                "ended_while_gone": sum(
                    1 for r in stranded if record.terminal_at.get(r, 2.0**62) < back
                ),
                "finished_on": {r: _finisher(r, events) for r in stranded},
                "gone_s": round(min(back, record.finished_at or back) - lost, 1),
                "all_ended_after_loss_s": round(max(times), 1) if times else None,
            }
        )
    ordered = sorted(after)
    hits: Counter[str] = Counter()
    for fired in record.fired.values():
        hits.update(str(f.get("window")) for f in fired)
    kills = [k for k in record.server_kills if "killed_at" in k]
    commits = sum(sum(b.keys.values()) for b in branches.values())
    return {
        "runs": len(record.runs),
        "runs_by_phase": dict(Counter(r.phase for r in runs.values())),
        "runs_submitted_per_host": {
            h: sum(1 for i in record.runs.values() if i.host == h) for h in record.hosts
        },
        "runs_completed_per_host": {h: completed_on[h] for h in record.hosts}
        | ({"unknown": completed_on["unknown"]} if completed_on["unknown"] else {}),
        "runs_finished_elsewhere": sum(
            1
            for r, ev in runs.items()
            if ev.phase == "completed" and _finisher(r, events) not in (None, record.runs[r].host)
        ),
        "takeovers_across_hosts": len(across),
        "host_losses": len([ls for ls in record.losses if "lost_at" in ls]),
        "host_recoveries": sum(1 for ls in record.losses if "returned_at" in ls),
        "lost_runs_continued_elsewhere": sum(
            1
            for ls in record.losses
            for r in ls.get("runs", {})
            if r in record.terminal_at
            and record.terminal_at[r] < float(ls.get("returned_at", 2.0**62))
        ),
        "time_to_complete_after_loss_s": {
            "p50": round(ordered[len(ordered) // 2], 1) if ordered else None,
            "max": round(ordered[-1], 1) if ordered else None,
            "by_loss": per_loss,
        },
        "git_server_kills": len(kills),
        "git_server_kills_with_push_in_flight": sum(
            1 for k in kills if int(k.get("pushes_in_flight", 0))
        ),
        "jobs_retried_on_server_kill": len(cut_jobs(record, events)),
        "operator_retries": dict(
            Counter(
                "accepted"
                if c["exit"] == 0
                else "refused: the run moved on"
                if any(why in str(c.get("stderr", "")) for why in _RETRY_RACED)
                else "failed"
                for ls in record.losses
                for c in ls.get("commands", [])
                if c["what"] == "retry"
            )
        ),
        "commits_per_write": {str(n): c for n, c in sorted(per_write.items())},
        "commits_per_write_by_run": by_run,
        "commits": commits,
        "fence_commits": sum(b.fences for b in branches.values()),
        "duplicate_commits": duplicate_commits,
        "duplicate_effects": duplicate_commits + duplicate_orders,
        "effects": commits + sum(sum(e.orders.values()) for e in evidence.effects.values()),
        "worker_kills_per_host": kills_by_host(record),
        "failpoint_hits": dict(sorted(hits.items())),
        "workers_started_per_host": record.workers_started,
        "remote": {"url": record.remote_url, "served_by": record.remote_served},
    }
