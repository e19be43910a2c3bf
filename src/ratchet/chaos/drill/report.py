"""The drill report: one JSON object, or a rich table for a person; and the entry point.

:func:`run_drill` runs the processes, gathers the evidence, checks every invariant and
returns the report as a dict (what ``ratchet drill --json`` prints). ``verdict`` is
``pass`` only when every invariant passed and none is unknown.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from ratchet.chaos.drill.checker import check
from ratchet.chaos.drill.evidence import gather
from ratchet.chaos.drill.runner import DrillOptions, Progress, run_drill_processes

__all__ = ["render", "run_drill"]


def run_drill(options: DrillOptions, *, progress: Progress | None = None) -> dict[str, Any]:
    """Run a drill and return its report. Every process it started is stopped before it
    returns, also on errors. Raises ConfigurationError on a bad setup."""
    started = time.monotonic()
    record, fleet, close = run_drill_processes(options, progress=progress)
    try:
        verdicts = check(record, gather(record, fleet))
    finally:
        close()
    report: dict[str, Any] = {
        "verdict": verdicts.verdict,
        "failed_invariants": verdicts.failed,
        "invariants": {i.name: i.as_dict() for i in verdicts.invariants},
        **verdicts.figures,
        "options": {
            "workers": options.workers,
            "runs": options.runs,
            "lease_ttl_s": options.lease_ttl_s,
            "duration_s": options.duration_s,
            "faults": sorted(options.faults),
            "seed": options.seed,
            "think_ms": options.think_ms,
            "topology": options.topology,
            "min_replicas_ack": options.min_replicas_ack,
        },
        "settle_bound_s": options.settle_bound_s,
        "redis_version": ".".join(map(str, record.redis.version)),
        "rollback": (
            {"cut_s": record.rollback["cut_s"], "rewound": record.rollback["rewound"]}
            if record.rollback
            else None
        ),
        "rollback_skipped": record.rollback_skipped,
        "worker_specs_used": record.specs_used,
        "worker_specs_unfired": sorted(
            w["spec"] for w in record.workers if w["spec"] and w["fired"] is None
        ),
        "drill_errors": record.errors[:20],
        "folder": str(record.folder),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    (record.folder / "report.json").write_text(json.dumps(report, sort_keys=True, indent=2))
    if record.metrics is not None:  # every worker's last scrape, for a closer look
        (record.folder / "metrics.json").write_text(
            json.dumps(
                {
                    str(w.pid): {
                        "port": w.port,
                        "last_scrape_at": w.started_at,
                        "scrapes": w.scrapes,
                        "failures": w.failures,
                        "values": w.values,
                    }
                    for w in record.metrics.workers.values()
                },
                sort_keys=True,
                indent=2,
            )
        )
    return report


def render(report: dict[str, Any], console: Console) -> None:
    """The report as tables for a terminal."""
    verdict = report["verdict"]
    colour = {"pass": "green", "fail": "red"}.get(verdict, "yellow")
    figures = Table(title=f"ratchet drill: [{colour}]{verdict}[/{colour}]", show_header=False)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for name in (
        "runs",
        "intents",
        "effects",
        "duplicate_effects",
        "stale_commits_attempted",
        "stale_commits_accepted",
        "stale_writes_attempted",
        "stale_writes_accepted",
        "stale_writes_refused_by_fence",
        "acked_checkpoints",
        "acked_checkpoints_lost",
        "acked_lost_to_rollback",
        "rewound_runs",
        "stuck_runs",
        "takeovers",
        "elapsed_s",
    ):
        figures.add_row(name, str(report.get(name)))
    figures.add_row("runs_by_phase", json.dumps(report["runs_by_phase"]))
    ms, ttl = report["takeover_ms"], report["takeover_ttl_multiple"]
    figures.add_row(
        "takeover p50 / p99 / max",
        f"{ms['p50']} / {ms['p99']} / {ms['max']} ms "
        f"({ttl['p50']} / {ttl['p99']} / {ttl['max']} x TTL)",
    )
    metrics = report.get("metrics") or {}
    if metrics.get("workers_scraped"):
        figures.add_row(
            "metrics: workers scraped / spawned",
            f"{metrics['workers_scraped']} / {metrics['workers_spawned']}",
        )
        figures.add_row(
            "metrics: takeovers, stale commits, stale writes, re-enqueues",
            f"{metrics['takeovers']}, {metrics['stale_commits_refused']}, "
            f"{metrics['stale_adapter_writes_refused']}, "
            f"{metrics['reaper_requeues']}",
        )
    console.print(figures)
    invariants = Table(title="invariants")
    for column in ("invariant", "status", "injections", "detail"):
        invariants.add_column(column)
    for name, item in report["invariants"].items():
        style = {"pass": "green", "fail": "red"}.get(item["status"], "yellow")
        invariants.add_row(
            name, f"[{style}]{item['status']}[/{style}]", str(item["injections"]), item["detail"]
        )
    console.print(invariants)
    hits = Table(title="failpoint hits")
    hits.add_column("failpoint")
    hits.add_column("hits", justify="right")
    for name, count in report["failpoint_hits"].items():
        hits.add_row(name, str(count))
    for name, count in report["fault_injections"].items():
        hits.add_row(f"[dim]{name}[/dim]", str(count))
    console.print(hits)
    if report.get("rollback_skipped"):
        console.print(f"rollback skipped: {report['rollback_skipped']}")
