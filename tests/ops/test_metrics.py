"""Worker metrics: names and labels, and a fleet run scraped while a worker is SIGKILLed."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.fleet import metrics
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import run_keys
from ratchet.ops import submit
from ratchet.worker.job import execute_run
from tests.ops.helpers import (
    MakeWorkspace,
    free_block,
    poll,
    run_awaiting_approval,
    run_in_review,
    scrape,
)
from tests.worker.fleet_harness import holder_pid, phase, workers

NAMES = {
    "ratchet_jobs",
    "ratchet_leases_acquired",
    "ratchet_leases_taken_over",
    "ratchet_leases_renewed",
    "ratchet_leases_lost",
    "ratchet_commits",
    "ratchet_commit_duration_seconds",
    "ratchet_stale_commits_refused",
    "ratchet_stale_adapter_writes_refused",
    "ratchet_receipt_conflicts",
    "ratchet_approvals_requested",
    "ratchet_approvals_expired",
    "ratchet_reaper_requeues",
}


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_every_metric_is_registered_with_prometheus_names() -> None:
    families = {f.name for f in REGISTRY.collect() if f.name.startswith("ratchet_")}
    assert families >= NAMES
    assert metrics.JOBS._labelnames == ("outcome", "phase")  # no run or worker ids
    for family in REGISTRY.collect():
        if family.name.startswith("ratchet_") and family.type == "counter":
            assert not family.name.endswith("_total")  # the client appends _total itself


def test_a_job_counts_its_lease_commits_and_the_phase_it_left(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    before = {
        n: sample(n)
        for n in (
            "ratchet_leases_acquired_total",
            "ratchet_commits_total",
            "ratchet_commit_duration_seconds_count",
        )
    }
    done = sample("ratchet_jobs_total", outcome="finished", phase="completed")
    _root, document = workspace()
    run_id = submit(fleet, document)
    report = execute_run(fleet, run_id, owner="w-metrics")
    assert report.phase == "completed"
    assert sample("ratchet_leases_acquired_total") == before["ratchet_leases_acquired_total"] + 1
    commits = sample("ratchet_commits_total") - before["ratchet_commits_total"]
    assert commits == report.generation - 1  # every generation after the first, one commit
    # One round trip per commit, but the write's receipt commit travelled with the next
    # proposal's commit (the example agent plans ahead): one round trip fewer.
    assert sample("ratchet_commit_duration_seconds_count") == (
        before["ratchet_commit_duration_seconds_count"] + commits - 1
    )
    assert sample("ratchet_jobs_total", outcome="finished", phase="completed") == done + 1


def test_without_coalescing_every_commit_is_its_own_round_trip(
    settings: Settings, workspace: MakeWorkspace
) -> None:
    fleet = Fleet.connect(settings.model_copy(update={"coalesce_commits": False}))
    before = {
        n: sample(n) for n in ("ratchet_commits_total", "ratchet_commit_duration_seconds_count")
    }
    _root, document = workspace()
    report = execute_run(fleet, submit(fleet, document), owner="w-metrics-separate")
    assert report.phase == "completed"
    commits = sample("ratchet_commits_total") - before["ratchet_commits_total"]
    assert commits == report.generation - 1
    assert sample("ratchet_commit_duration_seconds_count") == (
        before["ratchet_commit_duration_seconds_count"] + commits
    )


def test_waiting_runs_count_approvals_and_receipt_conflicts(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    approvals = sample("ratchet_approvals_requested_total")
    conflicts = sample("ratchet_receipt_conflicts_total", reason="intent_conflict")
    run_awaiting_approval(fleet, workspace, "r-metrics-approval")
    run_in_review(fleet, workspace, "r-metrics-review")
    assert sample("ratchet_approvals_requested_total") == approvals + 1
    assert sample("ratchet_receipt_conflicts_total", reason="intent_conflict") == conflicts + 1


@pytest.mark.slow
def test_metrics_scraped_during_a_sigkill_run_match_what_redis_recorded(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    runs = {}
    for i in range(12):
        root = make_greeting_workspace(tmp_path / f"ws-{i}")
        doc = greeting_document(root, agent_config={"think_ms": 60}, runner="python")
        runs[submit(fleet, doc, run_id=f"m{i}-{os.getpid()}-{tmp_path.name}")] = root
    base = free_block(3)
    last: dict[int, dict[str, float]] = {}

    def scrape_all() -> None:
        for port in range(base, base + 3):
            got = scrape(port)
            if got is not None:
                last[port] = got

    with workers(settings) as pool:
        procs = pool.start(3, env={"RATCHET_METRICS_PORT": str(base)})
        pids = {p.pid for p in procs}
        poll(
            lambda: (scrape_all(), len(last) == 3)[1],
            deadline_s=60,
            what="every worker serving metrics",
        )
        victim: list[int] = []

        def someone_mid_run() -> bool:
            scrape_all()
            for run_id in runs:
                pid = holder_pid(fleet, run_id)
                if pid in pids and fleet.store.read_run(run_id).generation >= 3:
                    os.kill(pid, signal.SIGKILL)
                    victim.append(pid)
                    return True
            return False

        poll(someone_mid_run, deadline_s=60, what="a worker holding a lease mid-run")

        def all_done() -> bool:
            scrape_all()
            return all(phase(fleet, r) == "completed" for r in runs)

        poll(all_done, deadline_s=120, what="every run completed")
        scrape_all()  # the survivors' final counts, scraped while they still run

    def total(name: str) -> float:
        return sum(
            v
            for values in last.values()
            for k, v in values.items()
            if k == name or k.startswith(name + "|")
        )

    # What Redis recorded: a run taken over from its dead holder has a takeover incident
    # naming the lease it ended, its history commits under one more lease version, and it
    # changes owner once, from the lease the incident names.
    client = fleet.store.client
    extra_acquisitions = owner_changes = 0
    for run_id in runs:
        entries = [e.decode().split("|") for e in client.lrange(run_keys(run_id).history, 0, -1)][
            ::-1
        ]
        leased = [(int(e[2]), e[3]) for e in entries if int(e[2]) >= 1]  # not the creation
        extra_acquisitions += len({version for version, _ in leased}) - 1
        owner_changes += sum(1 for a, b in itertools.pairwise(leased) if a[1] != b[1])
        ended = {
            (i["previous_owner"], i["previous_lease_version"])
            for i in fleet.store.records.incidents(run_id)
            if i.get("kind") == "lease_taken_over"
        }
        assert ended <= {(owner, version) for version, owner in leased}
    reaped = sum(1 for r in runs if client.hget(run_keys(r).lease, "reaped_version"))
    assert extra_acquisitions >= 1 and owner_changes >= 1
    assert total("ratchet_leases_taken_over_total") == extra_acquisitions == owner_changes
    assert total("ratchet_reaper_requeues_total") == reaped == extra_acquisitions
    assert total("ratchet_reaper_requeues_total|cause=lease_expired") == reaped
    assert total("ratchet_stale_commits_refused_total") == 0  # a dead worker sends nothing
    assert total("ratchet_stale_adapter_writes_refused_total") == 0
    assert total("ratchet_jobs_total|outcome=finished|phase=completed") >= len(runs) - 1
    assert total("ratchet_commits_total") > 0
