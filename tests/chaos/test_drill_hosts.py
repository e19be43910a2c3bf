"""`ratchet drill --hosts N`: the multi-host drill.

The short profile runs in CI (root and util-linux: each host is a mount and UTS
namespace); the checker's invariants are judged on synthetic evidence too (each can fail,
and says unknown when nothing happened to judge); the namespace harness keeps two disks
apart at one path and loses a host whole; seeds of the short profile are opt-in
(``-m chaos``, ``RATCHET_DRILL_HOSTS_SEEDS=first-last``, 1-20 by default).
"""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ratchet.chaos.drill.hostchecks import HostEvidence, RunEvidence, TaskEffects, judge
from ratchet.chaos.drill.hostns import HostNamespace, namespaces_usable
from ratchet.chaos.drill.hostplan import (
    HOST_FAULTS,
    HostDrillOptions,
    HostDrillRecord,
    RunInfo,
    parse_host_faults,
)
from ratchet.chaos.drill.hostreport import figures, render_hosts
from ratchet.errors import ConfigurationError
from tests.chaos.drill_support import RATCHET, run_drill

#: Why a drill of hosts cannot run here (None: it can).
NO_HOSTS = namespaces_usable()
needs_hosts = pytest.mark.skipif(NO_HOSTS is not None, reason=str(NO_HOSTS))


def ci_profile(seed: int | None = None) -> list[str]:
    """Three hosts, two workers each, 36 runs, each host lost once (one at a time) and
    brought back, every multi-host fault."""
    args = ["--hosts", "3", "--workers", "2", "--runs", "36", "--host-losses", "3"]
    args += ["--lease-ttl", "1", "--faults", "all"]
    return [*args, "--seed", str(seed)] if seed is not None else args


def _not_passed(report: dict[str, Any]) -> dict[str, Any]:
    """The invariants that did not pass, with their details."""
    return {k: v["detail"] for k, v in report["invariants"].items() if v["status"] != "pass"}


@needs_hosts
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_short_profile_keeps_every_run_on_its_host_once(tmp_path: Path) -> None:
    started = time.monotonic()
    code, report = run_drill(tmp_path / "drill", *ci_profile(), timeout_s=380)
    assert not _not_passed(report), _not_passed(report)
    assert code == 0 and report["verdict"] == "pass"
    # Every run ended on the host it was submitted on, each effect once.
    assert report["duplicate_effects"] == 0
    phases = report["runs_by_phase"]
    completed, cancelled = phases["completed"], phases.get("cancelled", 0)
    assert completed + cancelled == report["runs"]
    assert 3 * completed <= report["effects"] <= 3 * (completed + cancelled)
    per_host = report["runs_completed_per_host"]
    assert sorted(per_host) == ["drill-host-1", "drill-host-2", "drill-host-3"]
    assert all(n >= 10 for n in per_host.values()), per_host
    assert all(n >= 1 for n in report["worker_kills_per_host"].values())
    # Each host lost whole and brought back; its runs waited and ended after.
    assert report["host_losses"] == report["host_recoveries"] == 3
    assert {loss["host"] for loss in report["losses"]} == set(per_host)
    after = report["time_to_complete_after_return_s"]
    assert after["max"] is not None and after["max"] < report["options"]["duration_s"]
    for loss in report["losses"]:
        assert loss["runs"] and set(loss["waiting_seen"]) == set(loss["runs"])
        assert loss["killed"] >= 3  # the holder, two workers, the submitter at least
    # Jobs put on the wrong queue were handed on to their host.
    assert report["jobs_routed"] >= 1
    # The operator's paths: a retry, cancels (each task submitted again), a rebaseline
    # refused on another host and applied on the run's own.
    retries = [c for ls in report["losses"] for c in ls.get("commands", [])]
    assert retries and all(c["exit"] == 0 for c in retries if c["what"] == "retry")
    assert cancelled >= 1
    rebased = [ls["rebaseline"] for ls in report["losses"] if "rebaseline" in ls]
    assert rebased and all(r["wrong_host"]["exit"] != 0 for r in rebased)
    assert all(r["own_host"]["exit"] == 0 for r in rebased)
    assert "not a directory" in rebased[0]["wrong_host"]["stderr"]
    assert time.monotonic() - started < 300


def _seeds() -> list[int]:
    """``RATCHET_DRILL_HOSTS_SEEDS`` (``first-last``), 1-20 by default."""
    first, _, last = os.environ.get("RATCHET_DRILL_HOSTS_SEEDS", "1-20").partition("-")
    return list(range(int(first), int(last or first) + 1))


@needs_hosts
@pytest.mark.chaos
@pytest.mark.timeout(20 * 400)
def test_seeds_of_the_short_profile_pass(tmp_path: Path) -> None:
    """No false failures: every seed passes every invariant."""
    failed: dict[int, Any] = {}
    for seed in _seeds():
        _code, report = run_drill(tmp_path / "drill", *ci_profile(seed), timeout_s=380)
        if _not_passed(report):
            failed[seed] = _not_passed(report)
    assert not failed, failed


@needs_hosts
@pytest.mark.chaos
@pytest.mark.timeout(400)
def test_hosts_that_share_one_name_fail_the_drill(tmp_path: Path) -> None:
    """Two machines given one RATCHET_HOST (a sitecustomize every process of the drill
    loads): runs submitted on host 2 are signed for host 1, whose workers cannot find
    their workspaces. The drill must say so, naming the invariant."""
    broken = str(Path(__file__).with_name("samehost"))
    path = os.pathsep.join(p for p in (broken, os.environ.get("PYTHONPATH", "")) if p)
    args = ["--hosts", "2", "--workers", "2", "--runs", "8", "--host-losses", "1"]
    code, report = run_drill(
        tmp_path / "drill", *args, "--seed", "1", env={"PYTHONPATH": path}, timeout_s=380
    )
    assert code == 1 and report["verdict"] == "fail"
    assert "runs_complete_on_their_own_host" in report["failed_invariants"]


# -- the checker on synthetic evidence --------------------------------------------------


def _scene(tmp_path: Path) -> tuple[HostDrillRecord, HostEvidence]:
    """Two hosts; run r0 on h1, run r1 on h2; h2 lost while r1 waited, then back; r1's
    job misrouted to h1, whose worker handed it on. Everything as it should be."""
    faults = frozenset({"kill", "host-loss", "host-return", "misroute"})
    options = HostDrillOptions(faults=faults, runs=2)
    record = HostDrillRecord(tmp_path, options, hosts=["h1", "h2"])
    for run_id, index, host in (("r0", 0, "h1"), ("r1", 1, "h2")):
        record.runs[run_id] = RunInfo(run_id, index, host, submitted_host=host)
        (record.host_backing(host) / f"ws-{index}").mkdir(parents=True)
        record.final[run_id] = ("terminal", "completed")
    record.fired = {h: [{"action": "kill", "window": "before_proposal"}] for h in ("h1", "h2")}
    record.terminal_at = {"r0": 5.0, "r1": 40.0}
    record.losses = [
        {
            "host": "h2",
            "lost_at": 10.0,
            "lost_at_ms": 10_000,
            "gone_seen_at": 14.0,
            "returned_at": 30.0,
            "returned_at_ms": 30_000,
            "runs": {"r1": {"generation": 4}},
            "generations_before_return": {"r1": 4},
            "waiting_seen": {"r1": 15.0},
            "misroutes": [{"run_id": "r1", "queue_host": "h1", "at": 16.0}],
        }
    ]
    events = [
        {"kind": "restore", "run_id": "r0", "lease_version": 1, "at": 1.0, "host": "h1"},
        {"kind": "restore", "run_id": "r1", "lease_version": 1, "at": 2.0, "host": "h2"},
        {"kind": "acquire", "run_id": "r1", "lease_version": 7, "at": 17.0, "host": "h1"},
        {"kind": "job_end", "run_id": "r1", "lease_version": 7, "at": 17.1, "host": "h1",
         "outcome": "routed", "detail": "to host h2"},
        {"kind": "restore", "run_id": "r1", "lease_version": 8, "at": 31.0, "host": "h2"},
    ]  # fmt: skip
    runs = {
        r: RunEvidence("completed", record.runs[r].host, {f"{r}-a", f"{r}-b", f"{r}-o"})
        for r in record.runs
    }
    effects = {
        i: TaskEffects(Counter({f"r{i}-a": 1, f"r{i}-b": 1}), Counter({f"r{i}-o": 1}))
        for i in (0, 1)
    }
    return record, HostEvidence(events, runs, effects)


def _verdicts(record: HostDrillRecord, evidence: HostEvidence) -> dict[str, str]:
    return {i.name: i.status for i in judge(record, evidence)}


def test_the_checker_passes_a_drill_that_went_right(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    verdicts = _verdicts(record, evidence)
    assert set(verdicts.values()) == {"pass"}, verdicts


def test_a_run_opened_by_another_host_s_worker_fails(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    evidence.events.append(
        {"kind": "restore", "run_id": "r1", "lease_version": 5, "at": 20.0, "host": "h1"}
    )
    verdicts = _verdicts(record, evidence)
    assert verdicts["runs_complete_on_their_own_host"] == "fail"
    assert verdicts["lost_hosts_runs_complete_after_return"] == "fail"  # and while gone
    # A job of it that ended any way but handed on opened it there too.
    record, evidence = _scene(tmp_path / "b")
    evidence.events[3]["outcome"] = "restore_refused"
    assert _verdicts(record, evidence)["gone_hosts_runs_untouched_elsewhere"] == "fail"


def test_an_effect_twice_or_unrecorded_fails(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    evidence.effects[1].orders["r1-o"] = 2
    assert _verdicts(record, evidence)["each_effect_exactly_once"] == "fail"
    record, evidence = _scene(tmp_path / "b")
    evidence.effects[0].journal["nobody-s-key"] = 1
    assert _verdicts(record, evidence)["each_effect_exactly_once"] == "fail"
    record, evidence = _scene(tmp_path / "c")
    del evidence.effects[0].journal["r0-b"]  # completed with one file write
    assert _verdicts(record, evidence)["each_effect_exactly_once"] == "fail"


def test_a_lost_host_s_run_that_moved_or_ended_while_gone_fails(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    record.losses[0]["generations_before_return"] = {"r1": 5}
    assert _verdicts(record, evidence)["lost_hosts_runs_complete_after_return"] == "fail"
    record, evidence = _scene(tmp_path / "b")
    record.terminal_at["r1"] = 20.0
    assert _verdicts(record, evidence)["lost_hosts_runs_complete_after_return"] == "fail"
    record, evidence = _scene(tmp_path / "c")
    evidence.runs["r1"].phase = "running"
    record.final["r1"] = ("frozen", "running")
    verdicts = _verdicts(record, evidence)
    assert verdicts["lost_hosts_runs_complete_after_return"] == "fail"
    assert verdicts["no_run_frozen"] == "fail"


def test_a_gone_host_s_run_not_shown_waiting_or_with_an_incident_fails(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    record.losses[0]["waiting_seen"] = {}
    assert _verdicts(record, evidence)["gone_hosts_runs_untouched_elsewhere"] == "fail"
    record, evidence = _scene(tmp_path / "b")
    evidence.runs["r1"].incidents = [
        {"kind": "restore_refused", "at_ms": 50_000, "message": "workspace root is not a directory"}
    ]
    assert _verdicts(record, evidence)["gone_hosts_runs_untouched_elsewhere"] == "fail"
    # The operator's retry while the host is gone is no fault of anyone's.
    record, evidence = _scene(tmp_path / "c")
    evidence.runs["r1"].incidents = [{"kind": "operator_retry", "at_ms": 20_000}]
    assert _verdicts(record, evidence)["gone_hosts_runs_untouched_elsewhere"] == "pass"


def test_an_incident_under_a_routed_job_s_lease_fails_routing(tmp_path: Path) -> None:
    """What the drill found: the routing worker took the expired lease over and recorded
    it before handing the run on. Judged by its own invariant, not twice."""
    record, evidence = _scene(tmp_path)
    evidence.runs["r1"].incidents = [
        {"kind": "lease_taken_over", "lease_version": 7, "at_ms": 17_000}
    ]
    verdicts = _verdicts(record, evidence)
    assert verdicts["routed_jobs_record_nothing"] == "fail"
    assert verdicts["gone_hosts_runs_untouched_elsewhere"] == "pass"


def test_nothing_to_judge_is_unknown_and_missing_faults_say_so(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    quiet = copy.deepcopy(record)
    quiet.losses = []
    quiet.fired = {}
    evidence.events = [e for e in evidence.events if e["kind"] != "job_end"]
    verdicts = _verdicts(quiet, evidence)
    assert verdicts["lost_hosts_runs_complete_after_return"] == "unknown"
    assert verdicts["routed_jobs_record_nothing"] == "unknown"
    assert verdicts["every_fault_fired"] == "unknown"


def test_fault_names_are_checked() -> None:
    assert parse_host_faults("all") == frozenset(HOST_FAULTS)
    assert parse_host_faults("kill,cancel") == {"kill", "cancel"}
    for bad in ("rollback", "host-loss", "retry", "kill,rebaseline", ""):
        with pytest.raises(ConfigurationError):
            parse_host_faults(bad)
    with pytest.raises(ConfigurationError):
        HostDrillOptions(hosts=2, runs=4).check()  # four runs a host at least
    order = HostDrillOptions(hosts=3, host_losses=7, seed=5).host_order()
    assert len(order) == 7 and all(a != b for a, b in itertools.pairwise(order))


def test_hosts_refuse_another_topology_in_one_line() -> None:
    done = subprocess.run(
        [RATCHET, "drill", "--hosts", "2", "--topology", "cluster", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "single Redis" in done.stderr


# -- the namespace harness ---------------------------------------------------------------


@needs_hosts
def test_two_hosts_see_two_disks_at_one_path_and_a_lost_host_is_gone_whole(
    tmp_path: Path,
) -> None:
    point = tmp_path / "disk"
    a = HostNamespace("ns-host-a", tmp_path / "a", point)
    b = HostNamespace("ns-host-b", tmp_path / "b", point)
    try:
        a.start()
        b.start()
        env = dict(os.environ)
        assert a.run(["hostname"], env=env).stdout.strip() == "ns-host-a"
        wrote = a.run(["sh", "-c", "echo on-a > f && pwd"], env=env)
        assert wrote.stdout.strip() == str(point)
        assert (tmp_path / "a" / "f").read_text() == "on-a\n"
        assert b.run(["cat", "f"], env=env).returncode != 0  # B's disk has no such file
        assert not (point / "f").exists()  # nor has the drill's own view of the path
        sleeper = a.popen(["sleep", "600"], env=env, log=tmp_path / "a.log")
        killed = a.lose()
        assert sleeper.pid in killed and sleeper.poll() is not None
        assert not a.up and b.up
        with pytest.raises(ConfigurationError):
            a.enter(["true"])
        a.start()  # back on the same disk
        assert a.run(["cat", "f"], env=env).stdout == "on-a\n"
    finally:
        a.lose()
        b.lose()


def test_the_report_renders_for_a_person(tmp_path: Path) -> None:
    record, evidence = _scene(tmp_path)
    report = {
        "verdict": "fail",
        **figures(record, evidence),
        "invariants": {i.name: i.as_dict() for i in judge(record, evidence)},
        "elapsed_s": 1.0,
    }
    assert report["runs_completed_per_host"] == {"h1": 1, "h2": 1}
    assert report["jobs_routed_by_hosts"] == {"h1 -> h2": 1}
    assert report["time_to_complete_after_return_s"]["max"] == 10.0
    console = Console(record=True, width=200)
    render_hosts(report, console)
    text = console.export_text()
    assert "runs_completed_per_host" in text and "routed_jobs_record_nothing" in text
