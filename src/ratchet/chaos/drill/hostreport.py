"""The multi-host drill's report: figures, the verdict, and tables for a terminal.

:func:`check_hosts` gathers the evidence (:mod:`ratchet.chaos.drill.hostchecks`), judges
every invariant and returns the report that ``ratchet drill --hosts N --json`` prints,
written to ``report.json`` in the drill folder too.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table

from ratchet.chaos.drill.hostchecks import HostEvidence, gather_hosts, judge, kills_by_host
from ratchet.chaos.drill.hostgitchecks import gather_git, git_figures, judge_git
from ratchet.chaos.drill.hostplan import HostDrillRecord
from ratchet.chaos.drill.invariant import Invariant
from ratchet.fleet.context import Fleet

__all__ = ["check_hosts", "figures", "render_hosts"]

_SHOWN = (
    "runs",
    "runs_completed_per_host",
    "jobs_routed",
    "host_losses",
    "host_recoveries",
    "duplicate_effects",
    "time_to_complete_after_return_s",
    "worker_kills_per_host",
    "elapsed_s",
)
_SHOWN_GIT = (
    "runs",
    "runs_submitted_per_host",
    "runs_completed_per_host",
    "takeovers_across_hosts",
    "host_losses",
    "host_recoveries",
    "lost_runs_continued_elsewhere",
    "git_server_kills",
    "commits_per_write",
    "duplicate_commits",
    "duplicate_effects",
    "worker_kills_per_host",
    "elapsed_s",
)


def check_hosts(record: HostDrillRecord, fleet: Fleet) -> dict[str, Any]:
    """Judge the drill and return its report (written to ``report.json`` too). The store
    must be up (and, with git runs, the git server)."""
    invariants: list[Invariant]
    if record.options.git:
        git = gather_git(record, fleet)
        invariants, shown = judge_git(record, git), git_figures(record, git)
    else:
        evidence = gather_hosts(record, fleet)
        invariants, shown = judge(record, evidence), figures(record, evidence)
    verdict = (
        "fail"
        if any(i.status == "fail" for i in invariants)
        else "unknown"
        if any(i.status == "unknown" for i in invariants)
        else "pass"
    )
    report: dict[str, Any] = {
        "verdict": verdict,
        "failed_invariants": [i.name for i in invariants if i.status == "fail"],
        "invariants": {i.name: i.as_dict() for i in invariants},
        **shown,
        "options": record.options.as_dict(),
        "verifier_sandbox": record.sandbox,
        "network_namespaces": False,
        "losses": record.losses,
        "cancels": record.cancels,
        "misroutes": record.misroutes,
        "server_kills": record.server_kills,
        "skipped": record.skipped,
        "drill_errors": record.errors[:20],
        "folder": str(record.folder),
        "elapsed_s": round(time.time() - record.started_at, 1),
    }
    (record.folder / "report.json").write_text(
        json.dumps(report, sort_keys=True, indent=2, default=str)
    )
    return report


def figures(record: HostDrillRecord, evidence: HostEvidence) -> dict[str, Any]:
    """The report's figures: runs per host, routing, losses, effects, timings."""
    events, runs, effects = evidence.events, evidence.runs, evidence.effects
    routed: Counter[str] = Counter()
    for event in events:
        if event.get("kind") == "job_end" and event.get("outcome") == "routed":
            to = str(event.get("detail", "")).removeprefix("to host ")
            routed[f"{event['host']} -> {to}"] += 1
    after: list[float] = []
    per_loss = []
    for loss in record.losses:
        if "returned_at" not in loss:
            continue
        times = [
            record.terminal_at[r] - float(loss["returned_at"])
            for r in loss.get("runs", {})
            if r in record.terminal_at
        ]
        after += times
        per_loss.append(
            {
                "host": loss["host"],
                "runs_waiting": len(loss.get("runs", {})),
                "gone_s": round(float(loss["returned_at"]) - float(loss["lost_at"]), 1),
                "all_ended_after_return_s": round(max(times), 1) if times else None,
            }
        )
    ordered = sorted(after)
    hits: Counter[str] = Counter()
    for fired in record.fired.values():
        hits.update(str(f.get("window")) for f in fired)
    duplicates = sum(
        max(0, c - 1) for e in effects.values() for c in (*e.journal.values(), *e.orders.values())
    )
    return {
        "runs": len(record.runs),
        "runs_by_phase": dict(Counter(r.phase for r in runs.values())),
        "runs_completed_per_host": {
            h: sum(
                1 for r, i in record.runs.items() if i.host == h and runs[r].phase == "completed"
            )
            for h in record.hosts
        },
        "jobs_routed": sum(routed.values()),
        "jobs_routed_by_hosts": dict(routed),
        "host_losses": sum(1 for ls in record.losses if "lost_at" in ls),
        "host_recoveries": sum(1 for ls in record.losses if "returned_at" in ls),
        "duplicate_effects": duplicates,
        "effects": sum(sum(e.journal.values()) + sum(e.orders.values()) for e in effects.values()),
        "time_to_complete_after_return_s": {
            "p50": round(ordered[len(ordered) // 2], 1) if ordered else None,
            "max": round(ordered[-1], 1) if ordered else None,
            "by_loss": per_loss,
        },
        "worker_kills_per_host": kills_by_host(record),
        "failpoint_hits": dict(sorted(hits.items())),
        "workers_started_per_host": record.workers_started,
    }


def render_hosts(report: dict[str, Any], console: Console) -> None:
    """The multi-host report as tables for a terminal."""
    verdict = report["verdict"]
    colour = {"pass": "green", "fail": "red"}.get(verdict, "yellow")
    figures = Table(title=f"ratchet drill --hosts: [{colour}]{verdict}[/{colour}]")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    git = (report.get("options") or {}).get("environment") == "git"
    for name in _SHOWN_GIT if git else _SHOWN:
        value = report.get(name)
        figures.add_row(name, value if isinstance(value, str) else json.dumps(value))
    console.print(figures)
    table = Table(title="invariants")
    for column in ("invariant", "status", "detail"):
        table.add_column(column)
    for name, item in report["invariants"].items():
        style = {"pass": "green", "fail": "red"}.get(item["status"], "yellow")
        table.add_row(name, f"[{style}]{item['status']}[/{style}]", item["detail"])
    console.print(table)
