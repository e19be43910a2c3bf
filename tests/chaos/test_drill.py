"""`ratchet drill` end to end: the short profile passes with every failpoint fired and its
scraped worker metrics matching the report, a build without the workspace fence fails
naming the invariant, and the long profile (opt-in)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ratchet.chaos.drill.cluster import choose_redis
from ratchet.chaos.drill.humans import FAR_OFF_NAME
from ratchet.chaos.drill.processfaults import TWIN_NAME
from ratchet.chaos.drill.runner import DrillOptions, _Drill
from ratchet.chaos.drill.schedule import FAULTS, Schedule, parse_faults
from ratchet.chaos.failpoints import POINTS
from tests.chaos.drill_support import drill_record, run_drill


def drill(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 420
) -> tuple[int, dict[str, Any]]:
    return run_drill(tmp_path / "drill", *args, env=env, timeout_s=timeout_s)


def ci_faults() -> str:
    """Every fault; disk-full and workspace-full only as root (each mounts a tmpfs, for
    Redis' folder and for the workspaces; without root it is skipped, which leaves its
    invariant unknown)."""
    if os.geteuid() == 0:
        return "all"
    return ",".join(f for f in FAULTS if f not in ("disk-full", "workspace-full"))


def ci_profile(seed: int | None = None) -> list[str]:
    args = ["--workers", "3", "--runs", "32", "--lease-ttl", "1", "--faults", ci_faults()]
    return [*args, "--seed", str(seed)] if seed is not None else args


def _needs_rollback_support() -> None:
    """`--faults all` includes an AOF rollback, which needs Redis 7.0+ and its
    redis-check-aof; without them the rewound-run invariant cannot be judged (unknown)."""
    reason = choose_redis(None, want_rollback=True).rollback_skip_reason
    if reason is not None:
        pytest.skip(f"no Redis 7.0+ for the rollback fault: {reason}")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_short_profile_passes_with_every_failpoint_fired_and_zombies_refused(
    tmp_path: Path,
) -> None:
    _needs_rollback_support()
    code, report = drill(tmp_path, *ci_profile())
    failing = {k: v for k, v in report["invariants"].items() if v["status"] != "pass"}
    assert report["verdict"] == "pass", failing
    assert code == 0
    for point in POINTS:
        assert report["failpoint_hits"].get(point, 0) >= 2, (point, report["failpoint_hits"])
    assert report["stale_writes_attempted"] >= 1
    assert report["stale_writes_refused_by_fence"] >= 1
    assert report["stale_writes_accepted"] == 0
    assert report["stale_commits_attempted"] >= 1
    assert report["stale_commits_accepted"] == 0
    assert report["duplicate_effects"] == 0
    # Operators cancelled runs mid-flight; each ended, attributed, with no second effect.
    assert report["operator_cancels"] >= 2
    assert report["invariants"]["operator_cancels_end_runs"]["status"] == "pass"
    cancelled = report["runs_by_phase"].get("cancelled", 0)
    corrupted = len(report["corrupted_runs"])
    # A run whose reviewer aborted it fails, by design.
    aborted = sum(1 for v in report["reviews"]["runs"].values() if v == "abort")
    assert (
        report["runs_by_phase"].get("completed", 0)
        >= report["runs"] - report["rewound_runs"] - cancelled - corrupted - aborted
    )
    # Every store fault fired (disk-full needs root for its tmpfs) and its invariant passed.
    injected = report["fault_injections"]
    for fault in ("redis-pause", "redis-slow", "maxmemory", "store-wipe", "corrupt-record"):
        assert injected[fault] >= 1, (fault, injected)
    assert injected["owner-collision"] >= 1
    if os.geteuid() == 0:
        assert injected["disk-full"] >= 1, injected
        assert injected["workspace-full"] >= 1, injected
        assert report["invariants"]["full_workspace_no_effect_lost"]["status"] == "pass"
    # Conflicts planted behind runs' backs were decided by a reviewer, once, never on a
    # decision signed before the environment moved.
    assert injected["reviews"] >= 1, injected
    assert report["invariants"]["reviews_decided_once"]["status"] == "pass"
    # A journal locked past the busy timeout: the jobs that met it were retried, not failed.
    assert injected["sqlite-busy"] >= 1, injected
    assert report["invariants"]["busy_journal_retried"]["status"] == "pass"
    assert report["invariants"]["wiped_store_ran_nothing"]["status"] == "pass"
    assert report["invariants"]["corrupted_runs_frozen"]["status"] == "pass"
    # The workers' own metrics, scraped during the drill, agree with what the drill saw.
    metrics = report["metrics"]
    assert report["invariants"]["metrics_match_report"]["status"] == "pass", metrics
    assert metrics["workers_scraped"] > 0
    assert metrics["stale_commits_refused"] >= 1
    assert metrics["stale_adapter_writes_refused"] >= 1
    assert metrics["stale_adapter_writes_refused"] <= metrics["report_adapter_refusals"]
    low, high = metrics["takeovers_bounds"]
    assert 1 <= low <= metrics["takeovers"] <= high
    assert metrics["reaper_requeues"] >= 1


def _seed_with_a_workspace_zombie(runs: int) -> int:
    """A seed whose first zombie pauses before its first write (the workspace's)."""
    for seed in range(1, 200):
        specs = Schedule(seed=seed, faults=parse_faults("pause"), runs=runs).specs
        if specs and specs[0] == "after_guard_before_adapter=pause@1":
            return seed
    raise AssertionError("no such seed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_build_without_the_workspace_fence_fails_the_drill_naming_the_invariant(
    tmp_path: Path,
) -> None:
    seed = _seed_with_a_workspace_zombie(8)
    # The broken build is made here, not in the product: a sitecustomize that every
    # process of the drill loads replaces the workspace journal's fence check.
    broken = str(Path(__file__).with_name("fenceless"))
    path = os.pathsep.join(p for p in (broken, os.environ.get("PYTHONPATH", "")) if p)
    code, report = drill(
        tmp_path,
        "--workers",
        "2",
        "--runs",
        "8",
        "--lease-ttl",
        "1",
        "--faults",
        "pause",
        "--seed",
        str(seed),
        env={"PYTHONPATH": path},
    )
    assert code == 1
    assert report["verdict"] == "fail"
    assert "stale_writes_refused" in report["failed_invariants"]
    assert report["stale_writes_accepted"] >= 1


@pytest.mark.chaos
@pytest.mark.timeout(1500)
def test_the_long_profile_passes(tmp_path: Path) -> None:
    _needs_rollback_support()
    code, report = drill(
        tmp_path,
        "--workers",
        "4",
        "--runs",
        "200",
        "--lease-ttl",
        "1",
        "--duration",
        "600",
        "--faults",
        "all",
        timeout_s=1400,
    )
    assert report["verdict"] == "pass", report["invariants"]
    assert code == 0


def _seeds() -> list[int]:
    """``RATCHET_DRILL_SEEDS`` (``first-last``), 1-50 by default."""
    first, _, last = os.environ.get("RATCHET_DRILL_SEEDS", "1-50").partition("-")
    return list(range(int(first), int(last or first) + 1))


@pytest.mark.chaos
@pytest.mark.timeout(50 * 240)
def test_seeds_of_the_ci_profile_pass(tmp_path: Path) -> None:
    """No false failures: every seed of the CI profile passes, judged by identity."""
    _needs_rollback_support()
    failed: dict[int, Any] = {}
    for seed in _seeds():
        _code, report = drill(tmp_path, *ci_profile(seed), timeout_s=420)
        if report["verdict"] != "pass":
            failed[seed] = {
                k: v["detail"] for k, v in report["invariants"].items() if v["status"] != "pass"
            }
    assert not failed, failed


def test_a_failpoint_still_short_of_its_hits_gets_more_specs_once_the_plan_is_used_up() -> None:
    schedule = Schedule(seed=7, faults=parse_faults("all"), runs=24)
    planned = [schedule.next_spec({}) for _ in range(schedule.remaining)]
    assert all(planned)
    covered = {point: Schedule.WANT_HITS for point in POINTS}
    assert schedule.next_spec(covered) == ""  # every failpoint reached: nothing more
    assert schedule.next_spec() == ""  # no fired log: nothing more
    short = {**covered, "after_receipt_before_state": 1}
    topup = schedule.next_spec(short)
    assert "after_receipt_before_state=kill" in topup
    extra = [schedule.next_spec(short) for _ in range(200)]
    assert 0 < sum(bool(s) for s in extra) < 200  # bounded
    again = Schedule(seed=7, faults=parse_faults("all"), runs=24)
    for _ in range(again.remaining):
        again.next_spec({})
    assert again.next_spec(short) == topup  # seeded: the same drill, the same top-ups


def test_past_forty_percent_of_the_runs_every_other_worker_aims_at_a_short_failpoint() -> None:
    schedule = Schedule(seed=7, faults=parse_faults("all"), runs=24)
    short = {point: Schedule.WANT_HITS for point in POINTS} | {"after_receipt_before_state": 0}
    early = [schedule.next_spec(short, progress=0.1) for _ in range(6)]
    assert not any(
        "after_receipt_before_state=kill" in s and s not in schedule.specs for s in early
    )
    late = [schedule.next_spec(short, progress=0.5) for _ in range(6)]
    aimed = [s for s in late if "after_receipt_before_state=kill" in s]
    assert len(aimed) >= 3  # every other spawn (and any planned one aiming there too)
    assert all(late)


class _Queue:
    """Stands in for the fleet's enqueue: what the drill's pacing puts on the queue."""

    def __init__(self) -> None:
        self.enqueued: list[str] = []

    def enqueue(self, run_id: str) -> None:
        self.enqueued.append(run_id)


def _paced_drill(tmp_path: Path, queue: _Queue, runs: int = 24) -> _Drill:
    rec = drill_record(tmp_path, runs={})
    options = DrillOptions(faults=frozenset(FAULTS), runs=runs, workers=3)
    drill = _Drill(options, rec, None, None, queue, None, None)  # type: ignore[arg-type]
    drill.pending = [f"r{i}" for i in range(runs)]
    drill.index = {r: i for i, r in enumerate(drill.pending)}
    drill.processes.hits.update({p: Schedule.WANT_HITS for p in POINTS})  # every failpoint covered
    return drill


def _settle_all(drill: _Drill, queue: _Queue) -> None:
    drill.settled = {r: ("terminal", "completed") for r in queue.enqueued}


def test_down_to_its_reserve_the_drill_makes_every_fault_due_and_slows_its_last_runs(
    tmp_path: Path,
) -> None:
    queue = _Queue()
    drill = _paced_drill(tmp_path, queue)
    drill.schedule.store_faults_at = [(k, 0.9) for k, _ in drill.schedule.store_faults_at]
    drill.schedule.rollback_at = 0.9  # nothing falls due early: no backlog
    to_come = drill.faults_to_come()
    assert to_come == len(drill.schedule.store_faults_at) + 1  # and the rollback
    assert drill._fault_clock() == 0.0  # read at the fraction of runs settled
    drill._submit()
    assert len(queue.enqueued) == 3 + 1  # a worker fault is still to come: workers + 1
    _settle_all(drill, queue)
    drill.pending = drill.pending[: to_come + 1]
    drill._submit()  # one above the reserve, then down to it: two in flight at most
    assert len(drill.pending) == to_come - 1
    assert len(queue.enqueued) == 4 + 2
    assert drill._fault_clock() == 1.0  # down to the reserve: every fault left is due
    drill._submit()
    assert len(queue.enqueued) == 4 + 2  # still two in flight
    drill.schedule.store_faults_at.clear()
    drill.schedule.rollback_at = None
    assert drill.faults_to_come() == 0
    assert drill._fault_clock() < 1.0  # nothing left to wait for


def test_while_a_redis_fault_waits_for_the_lane_two_runs_at_most_are_in_flight(
    tmp_path: Path,
) -> None:
    queue = _Queue()
    drill = _paced_drill(tmp_path, queue, runs=40)
    drill._submit()
    assert len(queue.enqueued) == 4  # nothing due yet: workers + 1
    _settle_all(drill, queue)  # 4 of 40 settled: corrupt-record (10 %) is due, not fired
    drill._submit()
    assert len(queue.enqueued) == 4 + 2
    drill.schedule.store_faults_at.pop(0)  # it fired; the next is not due yet
    drill._submit()
    assert len(queue.enqueued) == 4 + 4
    drill.rec.corrupted = {r: {} for r in queue.enqueued[-2:]}
    drill._submit()  # a corrupted run holds no place (a worker may refuse it late)
    assert len(queue.enqueued) == 4 + 4 + 2


class _Spawner:
    def __init__(self) -> None:
        self.spawned: list[str | None] = []

    def spawn(self, spec: str, *, name: str | None = None) -> Any:
        self.spawned.append(name)
        return SimpleNamespace(pid=1000 + len(self.spawned))


def test_only_a_twin_that_died_before_any_lease_is_started_again_never_the_far_off_worker(
    tmp_path: Path,
) -> None:
    """The far-off worker's exit at start-up is the point of it: started again (without
    its skew, under its name) it ran jobs, and counted as an owner-collision twin. A twin
    is started again only while it has taken no lease (it died at its epoch check, or its
    RQ loop quit on a Redis fault), at most four times."""
    drill = _paced_drill(tmp_path, _Queue())
    pool = _Spawner()
    drill.pool = pool  # type: ignore[assignment]
    far_off = SimpleNamespace(name=FAR_OFF_NAME, pid=50)
    twin = SimpleNamespace(name=TWIN_NAME, pid=51)
    worked = SimpleNamespace(name=TWIN_NAME, pid=52)
    events = drill.rec.events_dir
    events.mkdir(parents=True)
    acquire = {"kind": "acquire", "run_id": "r1", "lease_version": 3, "pid": 52, "at": 1.0}
    (events / "events-52.jsonl").write_text(json.dumps(acquire) + "\n")
    assert not drill.processes.respawn_twin(drill, far_off)  # type: ignore[arg-type]
    assert not drill.processes.respawn_twin(drill, worked)  # type: ignore[arg-type]
    assert drill.processes.respawn_twin(drill, twin)  # type: ignore[arg-type]
    assert pool.spawned == [TWIN_NAME] and drill.rec.twins == [1001]
    for _ in range(5):
        drill.processes.respawn_twin(drill, twin)  # type: ignore[arg-type]
    assert len(pool.spawned) == 4  # at most four restarts
    drill.injecting = False
    drill.processes.twin_restarts = 0
    assert not drill.processes.respawn_twin(drill, twin)  # type: ignore[arg-type]


def test_failpoints_short_of_their_hits_hold_runs_back_like_faults(tmp_path: Path) -> None:
    """A failpoint still short of its hits needs runs left for its aimed worker to land
    in: two of them (at most) count as faults to come, so the drill keeps a reserve."""
    drill = _paced_drill(tmp_path, _Queue())
    covered = drill.faults_to_come()
    drill.processes.hits["after_receipt_before_state"] = 1
    assert drill.faults_to_come() == covered + 1
    drill.processes.hits["during_renewal"] = 0
    drill.processes.hits["workspace_after_intent"] = 0
    assert drill.faults_to_come() == covered + 2  # two at most
    schedule = Schedule(seed=3, faults=parse_faults("all"), runs=24)
    assert schedule.short({p: 2 for p in POINTS}) == 0
    assert schedule.short({}) > 2
    # Past 60 % of the runs settled, every new worker is aimed at a short failpoint, even
    # while planned specs are left (before, every other one).
    assert schedule.remaining > 3
    hits = {**{p: 2 for p in POINTS}, "after_receipt_before_state": 0}
    aimed = [schedule.next_spec(hits, 0.7) for _ in range(3)]
    assert all("after_receipt_before_state" in spec for spec in aimed), aimed
    halfway = [schedule.next_spec(hits, 0.5) for _ in range(4)]
    assert sum("after_receipt_before_state" in spec for spec in halfway) == 2, halfway
