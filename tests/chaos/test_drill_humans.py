"""Approvers and skewed clocks in the drill: each invariant on synthetic evidence (pass,
fail, unknown), the skew shim in a real interpreter, and a short drill of both faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ratchet.chaos.drill.humanchecks import (
    ApprovalRun,
    HumanFacts,
    no_expired_approval_executed,
    no_replayed_approval_accepted,
    skewed_clocks_harmless,
)
from ratchet.chaos.drill.humans import approval_runs
from ratchet.chaos.drill.report import run_drill
from ratchet.chaos.drill.runner import DrillOptions
from ratchet.chaos.drill.schedule import FAULTS, parse_faults
from ratchet.chaos.drill.skew import skew_env

TTL_MS = 1000


def approval(run: str, kind: str, nonce: str, *, target: str | None = None, **kw: Any) -> dict:
    return {
        "run": run,
        "target": target or run,
        "kind": kind,
        "nonce": nonce,
        "digest": f"d-{nonce}",
        "expires_at": kw.pop("expires_at", 1000),
        "approver_skew_s": kw.pop("skew", 0.0),
        "posted": kw.pop("posted", "checked" if kind in ("short", "valid") else "raw"),
        **kw,
    }


def record(
    approvals: list[dict],
    *,
    skews: dict | None = None,
    far: int | None = None,
    deaths: list[dict] | None = None,
    runs: list[str] = ("r1", "r2"),
) -> SimpleNamespace:
    humans = {
        "approval_runs": list(runs),
        "approvals": approvals,
        "skews": skews or {},
        "far_off": {"pid": far, "skew_s": -7200.0} if far is not None else None,
    }
    return SimpleNamespace(
        humans=humans,
        corrupted={},
        rollback=None,
        deaths=deaths or [],
        options=SimpleNamespace(ttl_ms=TTL_MS, faults=frozenset(FAULTS)),
    )


def completed(run: str, nonce: str, at: int = 990) -> ApprovalRun:
    return ApprovalRun(
        run,
        "terminal",
        "completed",
        consumed=[nonce],
        taken=[f"d-{nonce}"],
        orders=[(f"d-{nonce}", at)],
    )


RACED = [
    approval("r1", "short", "n1", expires_at=900),
    approval("r1", "valid", "n2"),
    approval("r1", "stale", "n3"),
    approval("r1", "replay", "n2"),
    approval("r1", "wrong_run", "n2", target="r2"),
    approval("r2", "short", "n4"),
]


def test_an_order_under_an_unexpired_bound_approval_passes() -> None:
    facts = HumanFacts(runs={"r1": completed("r1", "n2"), "r2": completed("r2", "n4")})
    assert no_expired_approval_executed(record(RACED), facts).status == "pass"


def test_an_order_committed_after_its_approval_expired_fails() -> None:
    facts = HumanFacts(runs={"r1": completed("r1", "n1", at=901), "r2": completed("r2", "n4")})
    verdict = no_expired_approval_executed(record(RACED), facts)
    assert verdict.status == "fail" and "n1" in verdict.detail


def test_a_completed_approval_run_with_two_orders_fails() -> None:
    twice = completed("r1", "n2")
    twice.orders.append(("d-n2", 991))
    facts = HumanFacts(runs={"r1": twice, "r2": completed("r2", "n4")})
    assert no_expired_approval_executed(record(RACED), facts).status == "fail"


def test_a_run_waiting_with_its_lease_released_passes_and_a_held_one_fails() -> None:
    waiting = ApprovalRun("r2", "waiting", "awaiting_approval")
    facts = HumanFacts(runs={"r1": completed("r1", "n2"), "r2": waiting})
    assert no_expired_approval_executed(record(RACED), facts).status == "pass"
    waiting.lease_live = True
    assert no_expired_approval_executed(record(RACED), facts).status == "fail"


def test_no_short_approval_raced_means_unknown() -> None:
    facts = HumanFacts(runs={"r1": completed("r1", "n2")})
    verdict = no_expired_approval_executed(record([approval("r1", "valid", "n2")]), facts)
    assert verdict.status == "unknown"


def test_replays_and_wrong_run_approvals_refused_pass() -> None:
    facts = HumanFacts(
        runs={"r1": completed("r1", "n2"), "r2": completed("r2", "n4")},
        holders={"n2": "r1", "n4": "r2"},
    )
    assert no_replayed_approval_accepted(record(RACED), facts).status == "pass"


def test_a_wrong_run_approval_consumed_fails() -> None:
    r2 = completed("r2", "n4")
    r2.consumed.append("n2")
    facts = HumanFacts(runs={"r1": completed("r1", "n2"), "r2": r2})
    verdict = no_replayed_approval_accepted(record(RACED), facts)
    assert verdict.status == "fail" and "n2" in verdict.detail


def test_an_approval_taken_twice_fails() -> None:
    r1 = completed("r1", "n2")
    r1.taken.append("d-n2")
    facts = HumanFacts(runs={"r1": r1, "r2": completed("r2", "n4")})
    assert no_replayed_approval_accepted(record(RACED), facts).status == "fail"


def test_a_replay_the_checked_post_let_through_fails() -> None:
    let_through = [*RACED, approval("r1", "replay", "n2", posted="checked")]
    facts = HumanFacts(runs={"r1": completed("r1", "n2"), "r2": completed("r2", "n4")})
    assert no_replayed_approval_accepted(record(let_through), facts).status == "fail"


def test_no_replay_posted_means_unknown() -> None:
    facts = HumanFacts(runs={"r1": completed("r1", "n2")})
    plain = [approval("r1", "valid", "n2")]
    assert no_replayed_approval_accepted(record(plain), facts).status == "unknown"


def evidence(acquires: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(events={"acquire": acquires})


def acquire(pid: int, version: int, *, previous: int = 0, took_over: bool = False) -> dict:
    return {
        "pid": pid,
        "run_id": "r1",
        "lease_version": version,
        "took_over": took_over,
        "previous_lease_version": previous,
    }


FAR = 99
GOOD = [acquire(10, 5_000), acquire(11, 6_500, previous=5_000, took_over=True)]


def test_skewed_workers_working_and_a_far_off_one_refused_pass() -> None:
    rec = record(
        [],
        skews={"10": 1.5, "11": -1.5, str(FAR): -7200},
        far=FAR,
        deaths=[{"pid": FAR, "exitcode": 2}],
    )
    facts = HumanFacts(commits={"r1": [(5_000, 5_400), (6_500, 6_600)]})
    assert skewed_clocks_harmless(rec, evidence(GOOD), facts).status == "pass"


def test_a_far_off_worker_that_acquired_a_lease_or_did_not_exit_2_fails() -> None:
    rec = record(
        [], skews={"10": 1.5, str(FAR): -7200}, far=FAR, deaths=[{"pid": FAR, "exitcode": 0}]
    )
    verdict = skewed_clocks_harmless(rec, evidence([*GOOD, acquire(FAR, 9_000)]), HumanFacts())
    assert verdict.status == "fail"
    assert "exited [0]" in verdict.detail and "acquired a lease" in verdict.detail


def test_a_takeover_before_the_ttl_or_a_commit_after_it_fails() -> None:
    rec = record(
        [], skews={"10": 1.5, str(FAR): -7200}, far=FAR, deaths=[{"pid": FAR, "exitcode": 2}]
    )
    early = [acquire(10, 5_000), acquire(11, 5_400, previous=5_000, took_over=True)]
    assert skewed_clocks_harmless(rec, evidence(early), HumanFacts()).status == "fail"
    late = HumanFacts(commits={"r1": [(5_000, 6_700)]})
    verdict = skewed_clocks_harmless(rec, evidence(GOOD), late)
    assert verdict.status == "fail" and "after its takeover" in verdict.detail


def test_an_expired_approval_of_a_skewed_approver_that_ran_fails() -> None:
    rec = record(
        [approval("r1", "valid", "n9", expires_at=100, skew=-90.0)],
        skews={"10": 1.5, str(FAR): -7200},
        far=FAR,
        deaths=[{"pid": FAR, "exitcode": 2}],
    )
    facts = HumanFacts(runs={"r1": completed("r1", "n9", at=101)})
    assert skewed_clocks_harmless(rec, evidence(GOOD), facts).status == "fail"


def test_no_skewed_worker_took_a_lease_means_unknown() -> None:
    rec = record([], skews={str(FAR): -7200}, far=FAR, deaths=[{"pid": FAR, "exitcode": 2}])
    assert skewed_clocks_harmless(rec, evidence(GOOD), HumanFacts()).status == "unknown"


def test_the_skew_shim_shifts_the_wall_clock_of_a_real_interpreter(tmp_path: Path) -> None:
    env = skew_env(tmp_path, -7200.0)
    code = "import time, json; print(json.dumps(time.time()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) < time.time() - 7000


def test_the_human_faults_are_in_all_and_a_quarter_of_runs_need_an_approval() -> None:
    assert {"approvals", "clock-skew"} <= parse_faults("all")
    chosen = approval_runs(3, 24)
    assert len(chosen) == 6 and chosen == approval_runs(3, 24)
    assert len(approval_runs(3, 4)) == 2


# The CI profile (tests/chaos/test_drill.py) runs the approvers and the skewed clocks and
# requires a pass; this drill of them alone is opt-in.
@pytest.mark.chaos
def test_a_short_drill_of_approvers_and_skewed_clocks_passes(tmp_path: Path) -> None:
    options = DrillOptions(
        workers=3,
        runs=12,
        lease_ttl_s=1,
        faults=frozenset({"kill", "approvals", "clock-skew"}),
        seed=5,
        folder=tmp_path / "drill",
        duration_s=120,
    )
    report = run_drill(options)
    inv = report["invariants"]
    for name in (
        "no_expired_approval_executed",
        "no_replayed_approval_accepted",
        "skewed_clocks_harmless",
        "every_fault_fired",
        "one_effect_per_intent",
    ):
        assert inv[name]["status"] == "pass", (name, inv[name])
    assert report["verdict"] != "fail"
