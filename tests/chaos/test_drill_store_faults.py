"""The store faults' invariants on synthetic evidence (each can pass, fail and be unknown),
the per-worker metrics comparison (a real lease loss is no false failure, a refusal no job
explains is a failure), the schedule, and a short drill of every store fault end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet.chaos.drill.checker import _metrics
from ratchet.chaos.drill.evidence import AdapterRecords, Evidence, RunFacts
from ratchet.chaos.drill.schedule import FAULTS, Schedule, parse_faults
from ratchet.chaos.drill.scrape import COUNTERS, MetricsWatch, Scrape
from ratchet.chaos.drill.storechecks import (
    corrupted_runs_frozen,
    owner_collision_fenced,
    redis_pause_fenced,
    slow_store_acks_kept,
    store_full_acks_kept,
    wiped_store_ran_nothing,
)
from ratchet.chaos.drill.storefaults import corrupt_run
from ratchet.leasing import run_keys
from ratchet.redis_server import RedisServer
from tests.chaos.drill_support import drill_record as record

RATCHET = str(Path(sys.executable).with_name("ratchet"))
STORE_FAULTS = (
    "redis-pause",
    "redis-slow",
    "disk-full",
    "maxmemory",
    "store-wipe",
    "corrupt-record",
    "owner-collision",
)


def facts(
    run_id: str,
    *,
    generation: int = 3,
    history: list[tuple[int, int, str]] | None = None,
    status: str = "terminal",
    incidents: list[dict[str, Any]] | None = None,
    files: int = 2,
    orders: int = 1,
    inversions: int = 0,
) -> RunFacts:
    adapters = AdapterRecords(
        file_effects={f"w{i}": 1 for i in range(files)},
        order_effects={f"o{i}": 1 for i in range(orders)},
        lease_inversions=inversions,
    )
    return RunFacts(
        run_id,
        0,
        status,
        "completed" if status == "terminal" else "running",
        generation,
        history if history is not None else [(3, 20, "d3"), (2, 10, "d2"), (1, 10, "d1")],
        set(),
        None,
        incidents or [],
        adapters,
    )


def evidence(runs: list[RunFacts], **events: list[dict[str, Any]]) -> Evidence:
    return Evidence([], dict(events), {f.run_id: f for f in runs})


def ev(kind: str, run_id: str, lease_version: int, at: float, **fields: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "run_id": run_id,
        "lease_version": lease_version,
        "at": at,
        "pid": 1,
        **fields,
    }


# -- redis-pause ----------------------------------------------------------------------------

PAUSE = {
    "kind": "redis-pause",
    "at": 100.0,
    "ended_at": 102.0,
    "paused_ms": 100_000,
    "resumed_ms": 102_000,
    "leases": [{"run_id": "r1", "lease_version": 10, "expires_at_ms": 101_000, "generation": 2}],
}


def test_redis_pause_passes_when_the_takeover_restored_above_every_old_commit(
    tmp_path: Path,
) -> None:
    rec = record(tmp_path, store_faults=[PAUSE])
    restores = [ev("restore", "r1", 20, 103.0, generation=2)]
    acks = [ev("ack", "r1", 10, 99.0, generation=2, digest="d2")]
    verdict = redis_pause_fenced(rec, evidence([facts("r1")], restore=restores, ack=acks))
    assert verdict.status == "pass", verdict.detail


def test_redis_pause_fails_on_a_commit_accepted_after_the_takeover(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[PAUSE])
    # Lease 20 restored at generation 1, yet lease 10 committed generation 2 afterwards.
    restores = [ev("restore", "r1", 20, 103.0, generation=1)]
    verdict = redis_pause_fenced(rec, evidence([facts("r1")], restore=restores))
    assert verdict.status == "fail"
    assert "g2 under lease 10" in verdict.detail


def test_redis_pause_fails_when_a_run_of_an_expired_lease_never_settled(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[PAUSE])
    verdict = redis_pause_fenced(rec, evidence([facts("r1", status="active")]))
    assert verdict.status == "fail"


def test_redis_pause_is_unknown_without_a_pause_or_an_expired_lease(tmp_path: Path) -> None:
    assert redis_pause_fenced(record(tmp_path), evidence([facts("r1")])).status == "unknown"
    unexpired = {**PAUSE, "leases": [{**PAUSE["leases"][0], "expires_at_ms": 109_000}]}  # type: ignore[dict-item]
    rec = record(tmp_path, store_faults=[unexpired])
    assert redis_pause_fenced(rec, evidence([facts("r1")])).status == "unknown"


def _rollback(at: float, cut_s: int, *rewound: str) -> dict[str, Any]:
    return {"at": at, "cut_s": cut_s, "rewound": list(rewound)}


def test_a_pause_before_the_rollback_leaves_its_rewound_runs_out(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[PAUSE], rollback=_rollback(110.0, 105, "r1"))
    verdict = redis_pause_fenced(rec, evidence([facts("r1", status="active")]))
    assert verdict.status == "unknown"  # what followed the pause was cut away


def test_a_pause_after_the_rollback_is_judged_on_its_rewound_runs(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[PAUSE], rollback=_rollback(90.0, 85, "r1"))
    verdict = redis_pause_fenced(rec, evidence([facts("r1", status="active")]))
    assert verdict.status == "fail"  # its expired lease's run never settled
    restores = [ev("restore", "r1", 20, 103.0, generation=2)]
    verdict = redis_pause_fenced(rec, evidence([facts("r1")], restore=restores))
    assert verdict.status == "pass", verdict.detail


# -- redis-slow -----------------------------------------------------------------------------

SLOW = {"kind": "redis-slow", "at": 100.0, "ended_at": 103.0, "sleeps": 6, "refused": None}


def test_redis_slow_passes_when_every_ack_meanwhile_is_in_the_history(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[SLOW])
    acks = [ev("ack", "r1", 20, 101.0, generation=3, digest="d3")]
    assert slow_store_acks_kept(rec, evidence([facts("r1")], ack=acks)).status == "pass"


def test_redis_slow_fails_on_an_ack_the_history_lacks(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[SLOW])
    acks = [ev("ack", "r1", 20, 101.0, generation=3, digest="other")]
    assert slow_store_acks_kept(rec, evidence([facts("r1")], ack=acks)).status == "fail"
    beyond = [ev("ack", "r1", 20, 101.0, generation=4, digest="d4")]
    assert slow_store_acks_kept(rec, evidence([facts("r1")], ack=beyond)).status == "fail"


def test_redis_slow_is_unknown_when_debug_was_refused(tmp_path: Path) -> None:
    refused = {**SLOW, "sleeps": 0, "refused": "ERR DEBUG command not allowed"}
    rec = record(tmp_path, store_faults=[refused], store_skipped={"redis-slow": "refused"})
    verdict = slow_store_acks_kept(rec, evidence([facts("r1")]))
    assert verdict.status == "unknown"
    assert "refused" in verdict.detail


def test_a_slow_ack_the_rollback_cut_away_is_excused_one_before_its_cut_is_not(
    tmp_path: Path,
) -> None:
    acks = [ev("ack", "r1", 20, 101.0, generation=4, digest="d4")]  # not in the history
    across = record(tmp_path, store_faults=[SLOW], rollback=_rollback(108.0, 101, "r1"))
    assert slow_store_acks_kept(across, evidence([facts("r1")], ack=acks)).status == "pass"
    later = record(tmp_path, store_faults=[SLOW], rollback=_rollback(120.0, 115, "r1"))
    assert slow_store_acks_kept(later, evidence([facts("r1")], ack=acks)).status == "fail"
    earlier = record(tmp_path, store_faults=[SLOW], rollback=_rollback(95.0, 90, "r1"))
    assert slow_store_acks_kept(earlier, evidence([facts("r1")], ack=acks)).status == "fail"


# -- maxmemory and disk-full ----------------------------------------------------------------

OOM = {
    "kind": "maxmemory",
    "at": 100.0,
    "ended_at": 103.0,
    "refused": "OOM command not allowed when used memory > 'maxmemory'.",
    "unsettled": ["r1"],
}


@pytest.mark.parametrize("kind", ["maxmemory", "disk-full"])
def test_store_full_passes_when_no_ack_was_a_refusal(tmp_path: Path, kind: str) -> None:
    fault = {**OOM, "kind": kind, "aof_ok": True}
    rec = record(tmp_path, store_faults=[fault])
    acks = [ev("ack", "r1", 20, 100.1, generation=3, digest="d3")]
    assert store_full_acks_kept(rec, evidence([facts("r1")], ack=acks), kind).status == "pass"


@pytest.mark.parametrize("kind", ["maxmemory", "disk-full"])
def test_store_full_fails_on_an_ack_absent_from_the_history(tmp_path: Path, kind: str) -> None:
    rec = record(tmp_path, store_faults=[{**OOM, "kind": kind}])
    acks = [ev("ack", "r1", 20, 101.0, generation=4, digest="d4")]
    verdict = store_full_acks_kept(rec, evidence([facts("r1")], ack=acks), kind)
    assert verdict.status == "fail"
    assert "r1 g4" in verdict.detail


def test_disk_full_fails_when_redis_never_wrote_its_aof_again(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[{**OOM, "kind": "disk-full", "aof_ok": False}])
    assert store_full_acks_kept(rec, evidence([facts("r1")]), "disk-full").status == "fail"


def test_store_full_fails_when_a_run_in_flight_never_settled(tmp_path: Path) -> None:
    rec = record(tmp_path, store_faults=[OOM])
    stuck = evidence([facts("r1", status="active")])
    assert store_full_acks_kept(rec, stuck, "maxmemory").status == "fail"


def test_store_full_is_unknown_when_skipped_or_never_refused(tmp_path: Path) -> None:
    skipped = record(tmp_path, store_skipped={"disk-full": "not running as root"})
    verdict = store_full_acks_kept(skipped, evidence([facts("r1")]), "disk-full")
    assert verdict.status == "unknown"
    assert "not running as root" in verdict.detail
    accepted = record(tmp_path, store_faults=[{**OOM, "refused": None}])
    assert store_full_acks_kept(accepted, evidence([facts("r1")]), "maxmemory").status == (
        "unknown"
    )


# -- corrupt-record -------------------------------------------------------------------------

CORRUPTED = {
    "r1": {
        "run_id": "r1",
        "how": "checkpoint",
        "at": 100.0,
        "at_ms": 100_000,
        "lease_version": 10,
        "effects": {"workspace": 1, "orders": 0},
    }
}
REFUSED = [{"kind": "restore_refused", "at_ms": 100_500, "reason": "checkpoint"}]


@pytest.mark.timeout(60)
def test_only_a_free_run_that_has_not_ended_is_corrupted(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        client = server.client()
        for run_id, phase, owner in (
            ("done", "completed", ""),
            ("held", "running", "w-1"),
            ("free", "running", ""),
        ):
            keys = run_keys(run_id)
            client.hset(keys.state, mapping={"phase": phase, "generation": 3})
            client.hset(keys.lease, mapping={"owner": owner, "lease_version": 7})
            client.set(keys.ckpt, b"0123456789")
        assert corrupt_run(client, "done", "checkpoint") is None  # ended: left alone
        assert corrupt_run(client, "held", "checkpoint") is None  # someone holds it
        assert client.get(run_keys("done").ckpt) == b"0123456789"
        assert client.get(run_keys("held").ckpt) == b"0123456789"
        got = corrupt_run(client, "free", "checkpoint")
        assert got is not None and got["lease_version"] == 7
        assert client.get(run_keys("free").ckpt) != b"0123456789"
    finally:
        server.kill()


def test_corrupted_runs_frozen_passes_with_a_refusal_and_nothing_run(tmp_path: Path) -> None:
    rec = record(tmp_path, corrupted=CORRUPTED)
    runs = [facts("r1", status="frozen", incidents=REFUSED, files=1, orders=0), facts("r2")]
    acquires = [ev("acquire", "r1", 30, 101.0)]  # finding out is allowed; running is not
    verdict = corrupted_runs_frozen(rec, evidence(runs, acquire=acquires))
    assert verdict.status == "pass", verdict.detail


def test_corrupted_runs_frozen_fails_when_a_corrupted_run_ran_again(tmp_path: Path) -> None:
    rec = record(tmp_path, corrupted=CORRUPTED)
    runs = [facts("r1", status="frozen", incidents=REFUSED, files=1, orders=0), facts("r2")]
    restores = [ev("restore", "r1", 30, 101.0, generation=2)]
    assert corrupted_runs_frozen(rec, evidence(runs, restore=restores)).status == "fail"


def test_corrupted_runs_frozen_fails_on_a_new_effect_or_no_refusal(tmp_path: Path) -> None:
    rec = record(tmp_path, corrupted=CORRUPTED)
    effect = [facts("r1", status="frozen", incidents=REFUSED, files=2, orders=0), facts("r2")]
    assert corrupted_runs_frozen(rec, evidence(effect)).status == "fail"
    old = [{"kind": "restore_refused", "at_ms": 99_000}]  # before the corruption
    silent = [facts("r1", status="active", incidents=old, files=1, orders=0), facts("r2")]
    verdict = corrupted_runs_frozen(rec, evidence(silent))
    assert verdict.status == "fail"
    assert "1 without a recorded refusal" in verdict.detail


def test_corrupted_runs_frozen_fails_when_the_fleet_stalled_on_others(tmp_path: Path) -> None:
    rec = record(tmp_path, corrupted=CORRUPTED)
    runs = [facts("r1", incidents=REFUSED, files=1, orders=0), facts("r2", status="active")]
    assert corrupted_runs_frozen(rec, evidence(runs)).status == "fail"


def test_corrupted_runs_frozen_is_unknown_without_a_corruption(tmp_path: Path) -> None:
    assert corrupted_runs_frozen(record(tmp_path), evidence([facts("r1")])).status == "unknown"


# -- store-wipe -----------------------------------------------------------------------------


def wipe(**fields: Any) -> dict[str, Any]:
    return {
        "at": 200.0,
        "enqueued": 2,
        "run_keys": [],
        "effects_before": {"r1": {"workspace": 2, "orders": 1}},
        "effects_after": {"r1": {"workspace": 2, "orders": 1}},
        **fields,
    }


def test_wiped_store_ran_nothing_passes_when_workers_refused_the_epoch(tmp_path: Path) -> None:
    rec = record(tmp_path, wipe=wipe())
    ends = [ev("job_end", "r1", 0, 201.0, outcome="store_epoch_changed")]
    before = [ev("acquire", "r1", 10, 150.0)]  # before the wipe: not the wipe's business
    verdict = wiped_store_ran_nothing(rec, evidence([facts("r1")], job_end=ends, acquire=before))
    assert verdict.status == "pass", verdict.detail


def test_wiped_store_ran_nothing_fails_when_a_worker_ran_on_it(tmp_path: Path) -> None:
    ends = [ev("job_end", "r1", 0, 201.0, outcome="store_epoch_changed")]
    rec = record(tmp_path, wipe=wipe())
    after = [ev("acquire", "r1", 1, 201.0)]
    assert wiped_store_ran_nothing(rec, evidence([], job_end=ends, acquire=after)).status == (
        "fail"
    )
    keyed = record(tmp_path, wipe=wipe(run_keys=["ratchet:{r1}:lease"]))
    assert wiped_store_ran_nothing(keyed, evidence([], job_end=ends)).status == "fail"
    changed = wipe(effects_after={"r1": {"workspace": 3, "orders": 1}})
    assert (
        wiped_store_ran_nothing(record(tmp_path, wipe=changed), evidence([], job_end=ends)).status
        == "fail"
    )


def test_wiped_store_ran_nothing_fails_when_nobody_reported_the_epoch(tmp_path: Path) -> None:
    verdict = wiped_store_ran_nothing(record(tmp_path, wipe=wipe()), evidence([]))
    assert verdict.status == "fail"
    assert "no worker reported" in verdict.detail


def test_wiped_store_ran_nothing_is_unknown_without_a_wipe(tmp_path: Path) -> None:
    assert wiped_store_ran_nothing(record(tmp_path), evidence([])).status == "unknown"


# -- owner-collision ------------------------------------------------------------------------


def acquire(pid: int, run_id: str, version: int, owner: str, **fields: Any) -> dict[str, Any]:
    return {**ev("acquire", run_id, version, 100.0, owner=owner, **fields), "pid": pid}


def test_owner_collision_passes_with_distinct_owners(tmp_path: Path) -> None:
    rec = record(tmp_path, twins=[7, 8])
    acquires = [
        acquire(7, "r1", 10, "drill-twin-aaa-7", took_over=False, previous_owner=""),
        acquire(8, "r2", 11, "drill-twin-bbb-8", took_over=False, previous_owner=""),
    ]
    verdict = owner_collision_fenced(rec, evidence([facts("r1"), facts("r2")], acquire=acquires))
    assert verdict.status == "pass", verdict.detail


def test_owner_collision_fails_when_one_entered_the_others_live_lease(tmp_path: Path) -> None:
    rec = record(tmp_path, twins=[7, 8])
    acquires = [
        acquire(7, "r1", 10, "drill-twin-7", took_over=False, previous_owner=""),
        acquire(8, "r1", 11, "drill-twin-7", took_over=False, previous_owner="drill-twin-7"),
    ]
    verdict = owner_collision_fenced(rec, evidence([facts("r1")], acquire=acquires))
    assert verdict.status == "fail"
    assert "1 owner ids shared" in verdict.detail


def test_owner_collision_fails_on_a_stale_write_accepted(tmp_path: Path) -> None:
    rec = record(tmp_path, twins=[7, 8])
    acquires = [
        acquire(7, "r1", 10, "a-7", took_over=False, previous_owner=""),
        acquire(8, "r2", 11, "b-8", took_over=False, previous_owner=""),
    ]
    runs = [facts("r1", inversions=1), facts("r2")]
    assert owner_collision_fenced(rec, evidence(runs, acquire=acquires)).status == "fail"


def test_owner_collision_is_unknown_until_both_twins_held_a_lease(tmp_path: Path) -> None:
    assert owner_collision_fenced(record(tmp_path), evidence([])).status == "unknown"
    rec = record(tmp_path, twins=[7, 8])
    one = [acquire(7, "r1", 10, "a-7", took_over=False, previous_owner="")]
    assert owner_collision_fenced(rec, evidence([facts("r1")], acquire=one)).status == "unknown"


# -- metrics by identity --------------------------------------------------------------------


def watch(pid: int, **values: float) -> MetricsWatch:
    base = {f"{name}_total": 0.0 for name in COUNTERS}
    for key, value in values.items():
        base[key.replace("__", "|").replace("_eq_", "=")] = value
    metrics = MetricsWatch(20000, 10)
    metrics.workers[pid] = Scrape(pid, 20000, values=base, started_at=500.0, scrapes=1)
    return metrics


def test_metrics_allow_a_real_lease_loss_logged_as_such(tmp_path: Path) -> None:
    """The false failure of the old count: a loaded worker's commit refused because its
    lease really was lost (its job ended lease_lost), beside a zombie's refusal."""
    rec = record(
        tmp_path, metrics=watch(1, ratchet_stale_commits_refused_total__reason_eq_lease_lost=2)
    )
    events = {
        "acquire": [ev("acquire", "r1", 10, 100.0), ev("acquire", "r2", 11, 100.0)],
        "stale_commit": [
            ev("stale_commit", "r1", 10, 101.0, outcome="rejected", error="LeaseLostError")
        ],
        "job_end": [
            ev("job_end", "r1", 10, 101.0, outcome="lease_lost"),
            ev("job_end", "r2", 11, 102.0, outcome="lease_lost"),
        ],
    }
    rec.metrics.workers[1].values["ratchet_leases_acquired_total"] = 2  # type: ignore[union-attr, index]
    ev_ = Evidence([], events, {"r1": facts("r1"), "r2": facts("r2")})
    verdict, figures = _metrics(rec, ev_, ev_.runs, 0)
    assert verdict.status == "pass", verdict.detail
    assert figures["refusable_jobs"] == 2


def test_metrics_fail_on_a_refusal_no_job_of_that_worker_explains(tmp_path: Path) -> None:
    rec = record(
        tmp_path, metrics=watch(1, ratchet_stale_commits_refused_total__reason_eq_lease_lost=2)
    )
    events = {
        "acquire": [ev("acquire", "r1", 10, 100.0)],
        "job_end": [ev("job_end", "r1", 10, 101.0, outcome="lease_lost")],
    }
    rec.metrics.workers[1].values["ratchet_leases_acquired_total"] = 1  # type: ignore[union-attr, index]
    ev_ = Evidence([], events, {"r1": facts("r1")})
    verdict, _ = _metrics(rec, ev_, ev_.runs, 0)
    assert verdict.status == "fail"
    assert "worker 1: stale commits" in verdict.detail


def test_metrics_fail_when_a_scraped_zombie_refusal_is_missing(tmp_path: Path) -> None:
    rec = record(tmp_path, metrics=watch(1, ratchet_leases_acquired_total=1))
    events = {
        "acquire": [ev("acquire", "r1", 10, 100.0)],
        "stale_commit": [
            ev("stale_commit", "r1", 10, 101.0, outcome="rejected", error="StaleStateError")
        ],
        "job_end": [ev("job_end", "r1", 10, 101.0, outcome="lease_lost")],
    }
    ev_ = Evidence([], events, {"r1": facts("r1")})
    verdict, _ = _metrics(rec, ev_, ev_.runs, 0)
    assert verdict.status == "fail"


def test_metrics_takeovers_follow_each_acquire_event(tmp_path: Path) -> None:
    rec = record(
        tmp_path,
        metrics=watch(1, ratchet_leases_acquired_total=1, ratchet_leases_taken_over_total=1),
    )
    events = {"acquire": [ev("acquire", "r1", 10, 100.0, took_over=False)]}
    ev_ = Evidence([], events, {"r1": facts("r1")})
    verdict, _ = _metrics(rec, ev_, ev_.runs, 0)
    assert verdict.status == "fail"
    assert "takeovers 1 not within [0, 0]" in verdict.detail
    events["acquire"][0]["took_over"] = True
    verdict, _ = _metrics(rec, ev_, ev_.runs, 0)
    assert verdict.status == "pass", verdict.detail


# -- the schedule and the drill -------------------------------------------------------------


def test_every_store_fault_is_a_fault_and_in_the_schedule() -> None:
    assert set(STORE_FAULTS) <= set(FAULTS)
    assert set(STORE_FAULTS) <= parse_faults("all")
    schedule = Schedule(seed=1, faults=parse_faults("all"), runs=24)
    planned = {kind for kind, _ in schedule.store_faults_at}
    assert planned == {"redis-pause", "redis-slow", "disk-full", "maxmemory", "corrupt-record"}
    assert schedule.store_wipe
    assert schedule.owner_collision_at is not None


def drill(tmp_path: Path, *args: str, timeout_s: float = 300) -> tuple[int, dict[str, Any]]:
    folder = tmp_path / "drill"
    done = subprocess.run(
        [RATCHET, "drill", *args, "--json", "--dir", str(folder)],
        capture_output=True,
        timeout=timeout_s,
        check=False,
        env=dict(os.environ),
    )
    assert done.stdout, done.stderr.decode(errors="replace")[-2000:]
    return done.returncode, json.loads(done.stdout)


# The CI profile (tests/chaos/test_drill.py) fires every store fault and requires a pass;
# this drill of the store faults alone is opt-in.
@pytest.mark.chaos
@pytest.mark.timeout(360)
def test_a_short_drill_of_every_store_fault_passes(tmp_path: Path) -> None:
    """Every store fault fires and its invariant passes (disk-full needs root for its
    tmpfs: otherwise it is skipped, with the reason, and the verdict is unknown)."""
    faults = ",".join((*STORE_FAULTS, "kill"))
    code, report = drill(
        tmp_path, "--workers", "3", "--runs", "12", "--lease-ttl", "1", "--faults", faults
    )
    invariants = report["invariants"]
    assert not report["failed_invariants"], {
        k: v for k, v in invariants.items() if v["status"] != "pass"
    }
    for name in (
        "redis_pause_fenced",
        "slow_store_acks_kept",
        "oom_no_ack_lost",
        "corrupted_runs_frozen",
        "owner_collision_fenced",
        "wiped_store_ran_nothing",
        "metrics_match_report",
    ):
        assert invariants[name]["status"] == "pass", (name, invariants[name])
    # Faults not asked for leave their own invariants unknown: the verdict is not pass.
    assert report["verdict"] == "unknown"
    assert code == 1
    if os.geteuid() == 0:
        assert invariants["disk_full_no_ack_lost"]["status"] == "pass", invariants
    else:
        assert invariants["disk_full_no_ack_lost"]["status"] == "unknown"
        assert "disk-full" in report["store_faults_skipped"]
    injected = report["fault_injections"]
    for fault in STORE_FAULTS:
        if fault != "disk-full" or os.geteuid() == 0:
            assert injected[fault] >= 1, (fault, injected)
    assert report["corrupted_runs"]
    assert not list((tmp_path / "drill").glob("redis-tmpfs-*")), "the tmpfs was not cleaned up"


# -- conflicts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "review", "expected"),
    [
        ("awaiting_approval", None, "unknown"),  # waiting for its approver: no conflict
        ("needs_review", None, "fail"),  # frozen without a rollback or any evidence
    ],
)
def test_a_run_waiting_for_its_approver_is_not_an_unexpected_conflict(
    tmp_path: Path, phase: str, review: str | None, expected: str
) -> None:
    import dataclasses

    from ratchet.chaos.drill.checker import check

    waiting = dataclasses.replace(facts("r2", status="waiting"), phase=phase, review_reason=review)
    verdicts = check(record(tmp_path), evidence([facts("r1"), waiting]))
    (conflicts,) = [i for i in verdicts.invariants if i.name == "conflicts_frozen_with_evidence"]
    assert conflicts.status == expected, conflicts.detail


@pytest.mark.parametrize(("refused", "expected"), [(True, "pass"), (False, "fail")])
def test_a_rewound_run_put_back_at_its_approval_is_frozen_once_its_restore_was_refused(
    tmp_path: Path, refused: bool, expected: str
) -> None:
    import dataclasses

    from ratchet.chaos.drill.checker import check

    incidents = [{"kind": "restore_refused", "reason": "environment_mismatch"}] if refused else []
    back = facts("r2", status="waiting", incidents=incidents)
    # Its adapters hold an effect its rewound checkpoint does not record.
    back = dataclasses.replace(
        back,
        phase="awaiting_approval",
        adapters=dataclasses.replace(back.adapters, receipt_keys={"k-order"}),
    )
    rollback = {"at": 50.0, "cut_s": 45, "rewound": {"r2": [10, 5]}}
    verdicts = check(record(tmp_path, rollback=rollback), evidence([facts("r1"), back]))
    (conflicts,) = [i for i in verdicts.invariants if i.name == "conflicts_frozen_with_evidence"]
    assert conflicts.status == expected, conflicts.detail


@pytest.mark.parametrize(("restored_at", "expected"), [(104.0, "fail"), (107.0, "pass")])
def test_a_stale_write_fails_only_when_accepted_past_a_newer_leases_fence(
    tmp_path: Path, restored_at: float, expected: str
) -> None:
    from ratchet.chaos.drill.checker import check

    # A zombie (pid 7, lease 10) resumed at 105 and wrote at 106: accepted. A newer lease
    # restored (its fence raised at every adapter) before it was sent, or only after.
    pauses = [{"pid": 7, "paused_at": 100.0, "resumed_at": 105.0, "run_id": "r1"}]
    write = {**ev("stale_write", "r1", 10, 106.0, outcome="accepted"), "pid": 7}
    restore = ev("restore", "r1", 20, restored_at, generation=3)
    rec = record(tmp_path, pauses=pauses)
    verdicts = check(rec, evidence([facts("r1")], stale_write=[write], restore=[restore]))
    (stale,) = [i for i in verdicts.invariants if i.name == "stale_writes_refused"]
    assert stale.status == expected, stale.detail


def test_a_journal_the_checker_could_not_recover_fails_one_effect_per_intent(
    tmp_path: Path,
) -> None:
    """A workspace journal whose lock was still held when the checker read it has no final
    answer (a half-done write may be unresolved): the checker fails closed, naming it."""
    import dataclasses

    from ratchet.chaos.drill.checker import check

    unrecovered = facts("r2")
    unrecovered.adapters = dataclasses.replace(
        unrecovered.adapters, journal_check="not recovered: locked (SQLITE_BUSY); ok"
    )
    verdicts = check(record(tmp_path), evidence([facts("r1"), unrecovered]))
    (effects,) = [i for i in verdicts.invariants if i.name == "one_effect_per_intent"]
    assert effects.status == "fail", effects.detail
    verdicts = check(record(tmp_path), evidence([facts("r1"), facts("r2")]))
    (effects,) = [i for i in verdicts.invariants if i.name == "one_effect_per_intent"]
    assert effects.status != "fail", effects.detail
