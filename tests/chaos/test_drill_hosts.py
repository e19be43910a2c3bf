"""`ratchet drill --hosts N`: the multi-host drill.

The short profile and the git profile (``--environment git``) run in CI (root and
util-linux: each host is a mount and UTS namespace; the git profile's server kill needs
the ``git`` program); the checkers' invariants are judged on synthetic evidence too (each
can fail, and says unknown when nothing happened to judge); the namespace harness keeps
two disks apart at one path and loses a host whole; the git server is killed and comes
back on its port; seeds of both profiles are opt-in (``-m chaos``,
``RATCHET_DRILL_HOSTS_SEEDS=first-last``, 1-20 by default).
"""

from __future__ import annotations

import copy
import itertools
import os
import shutil
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ratchet.adapters.gitremote import RemoteBranch
from ratchet.chaos.drill.hostchecks import HostEvidence, RunEvidence, TaskEffects, judge
from ratchet.chaos.drill.hostgit import (
    GitSchedule,
    GitServer,
    git_document,
    make_drill_remote,
    owner_host,
)
from ratchet.chaos.drill.hostgitchecks import (
    BranchEvidence,
    GitEvidence,
    git_figures,
    judge_git,
    read_branch,
)
from ratchet.chaos.drill.hostns import HostNamespace, namespaces_usable
from ratchet.chaos.drill.hostplan import (
    GIT_HOST_FAULTS,
    HOST_FAULTS,
    HostDrillOptions,
    HostDrillRecord,
    RunInfo,
    parse_host_faults,
)
from ratchet.chaos.drill.hostreport import figures, render_hosts
from ratchet.chaos.drill.services import NOTE, expected_note
from ratchet.errors import ConfigurationError
from tests.chaos.drill_support import RATCHET, run_drill

#: Why a drill of hosts cannot run here (None: it can).
NO_HOSTS = namespaces_usable()
needs_hosts = pytest.mark.skipif(NO_HOSTS is not None, reason=str(NO_HOSTS))
#: The git profile kills and restarts a ``git daemon``; without the program it is skipped.
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="the git program is missing")


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


def git_profile(seed: int | None = None) -> list[str]:
    """Three hosts, two workers each, 24 runs on branches of one git remote, two host
    losses, the git server killed mid-push twice, every fault of the git profile."""
    args = ["--hosts", "3", "--workers", "2", "--runs", "24", "--host-losses", "2"]
    args += ["--environment", "git", "--lease-ttl", "1", "--faults", "all"]
    return [*args, "--seed", str(seed)] if seed is not None else args


@needs_hosts
@needs_git
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_git_profile_continues_lost_hosts_runs_elsewhere_one_commit_per_write(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    code, report = run_drill(tmp_path / "drill", *git_profile(), timeout_s=380)
    assert not _not_passed(report), _not_passed(report)
    assert code == 0 and report["verdict"] == "pass"
    assert report["options"]["environment"] == "git"
    assert report["remote"]["served_by"] == "git daemon"
    # Every run completed or cancelled; each write exactly one commit on its branch.
    phases = report["runs_by_phase"]
    completed, cancelled = phases["completed"], phases.get("cancelled", 0)
    assert completed + cancelled == report["runs"] >= 24
    assert report["duplicate_commits"] == 0 and report["duplicate_effects"] == 0
    assert set(report["commits_per_write"]) == {"1"}
    by_run = report["commits_per_write_by_run"]
    assert all(set(counts) <= {1} for counts in by_run.values()), by_run
    assert sum(len(c) == 2 for c in by_run.values()) >= completed
    # Each lost host's stranded runs: taken by another host's worker, ended while gone.
    assert report["host_losses"] == report["host_recoveries"] == 2
    for loss in report["time_to_complete_after_loss_s"]["by_loss"]:
        assert loss["runs_stranded"] >= 1 and loss["ended_while_gone"] >= 1, loss
        elsewhere = [h for h in loss["finished_on"].values() if h not in (None, loss["host"])]
        assert elsewhere, loss
    assert report["takeovers_across_hosts"] >= 2
    # The git server was killed mid-push (and restarted); the kills hit the push too.
    assert report["git_server_kills_with_push_in_flight"] >= 1
    assert all("restarted_at" in k for k in report["server_kills"] if "killed_at" in k)
    assert all(n >= 1 for n in report["worker_kills_per_host"].values())
    assert {"git_before_push", "git_after_push"} <= set(report["failpoint_hits"])
    assert not {"workspace_after_intent", "workspace_after_replace"} & set(report["failpoint_hits"])
    assert time.monotonic() - started < 300


@needs_hosts
@needs_git
@pytest.mark.chaos
@pytest.mark.timeout(20 * 400)
def test_seeds_of_the_git_profile_pass(tmp_path: Path) -> None:
    """No false failures: every seed of the git profile passes every invariant."""
    failed: dict[int, Any] = {}
    for seed in _seeds():
        _code, report = run_drill(tmp_path / "drill", *git_profile(seed), timeout_s=380)
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


# -- the git profile's checker on synthetic evidence ------------------------------------

_BASE = "b" * 40


def _git_scene(tmp_path: Path) -> tuple[HostDrillRecord, GitEvidence]:
    """Two hosts; r0 submitted on h1, r1 on h2; h2 lost while its worker ran r1, which a
    worker of h1 took and finished before h2 came back; the git server killed once with a
    push in flight and restarted; the operator's retry of r1 refused (h1's worker held
    it), a cancel of r0 that came after it completed. Everything as it should be."""
    options = HostDrillOptions(faults=frozenset(GIT_HOST_FAULTS), runs=2, environment="git")
    record = HostDrillRecord(tmp_path, options, hosts=["h1", "h2"])
    record.remote_url = "git://127.0.0.1:9/drill.git"
    for run_id, index, host in (("r0", 0, "h1"), ("r1", 1, "h2")):
        record.runs[run_id] = RunInfo(run_id, index, host, submitted_host=host)
        record.final[run_id] = ("terminal", "completed")
    record.fired = {h: [{"action": "kill", "window": "git_after_push"}] for h in ("h1", "h2")}
    record.terminal_at = {"r0": 5.0, "r1": 20.0}
    record.finished_at = 40.0
    record.server_kills = [
        {"at": 0.3, "killed_at": 14.0, "restarted_at": 15.5, "pushes_in_flight": 1}
    ]
    record.cancels = [{"run_id": "r0", "command": {"exit": 0}}]  # it completed first
    record.losses = [
        {
            "host": "h2",
            "lost_at": 10.0,
            "lost_at_ms": 10_000,
            "returned_at": 30.0,
            "runs": {"r1": {"generation": 4}},
            "taken_elsewhere": {"r1": {"at": 11.5, "host": "h1"}},
            "retry": {"run_id": "r1"},
            "commands": [{"what": "retry", "exit": 2, "stderr": "a worker holds the run (h1-x-1)"}],
        }
    ]
    events = [
        {"kind": "ack", "run_id": "r0", "at": 4.0, "host": "h1"},
        {"kind": "acquire", "run_id": "r1", "at": 2.0, "host": "h2", "took_over": False},
        {"kind": "acquire", "run_id": "r1", "at": 11.4, "host": "h1", "took_over": True,
         "previous_owner": "h2-abc-7"},
        {"kind": "restore", "run_id": "r1", "at": 11.5, "host": "h1"},
        {"kind": "job_end", "run_id": "r1", "at": 14.5, "host": "h1", "outcome": "retry_later",
         "detail": "the git remote could not be reached (pushing)"},
        {"kind": "ack", "run_id": "r1", "at": 19.0, "host": "h1"},
    ]  # fmt: skip
    runs: dict[str, RunEvidence] = {}
    branches: dict[str, BranchEvidence] = {}
    for run_id, info in record.runs.items():
        writes = [
            {"key": f"{run_id}-{w}", "commit": f"c-{run_id}-{w}", "sha256": "s", "path": NOTE}
            for w in ("a", "b")
        ]
        runs[run_id] = RunEvidence(
            "completed",
            None,
            {f"{run_id}-a", f"{run_id}-b", f"{run_id}-o"},
            kind="git",
            remote={"url": record.remote_url, "branch": f"ratchet/{run_id}", "base": _BASE},
            git_writes=writes,
        )
        branches[run_id] = BranchEvidence(
            branch=f"ratchet/{run_id}",
            keys=Counter({w["key"]: 1 for w in writes}),
            commit_of={w["key"]: w["commit"] for w in writes},
            tree_of={w["commit"]: f"t-{w['commit']}" for w in writes},
            fences=2,
            base_tree="t-base",
            tip_tree=f"t-c-{run_id}-b",
            note=expected_note(info.index),
        )
    effects = {i: TaskEffects(orders=Counter({f"r{i}-o": 1})) for i in (0, 1)}
    return record, GitEvidence(events, runs, effects, branches)


def _git_verdicts(record: HostDrillRecord, evidence: GitEvidence) -> dict[str, str]:
    return {i.name: i.status for i in judge_git(record, evidence)}


def test_the_git_checker_passes_a_drill_that_went_right(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    verdicts = _git_verdicts(record, evidence)
    assert set(verdicts.values()) == {"pass"}, verdicts
    assert set(verdicts) == {
        "runs_complete_bound_to_no_host",
        "each_write_one_commit",
        "orders_exactly_once",
        "lost_hosts_runs_continue_elsewhere",
        "server_kill_no_double_commit",
        "operator_paths_no_double_effect",
        "no_run_frozen",
        "every_fault_fired",
    }
    shown = git_figures(record, evidence)
    assert shown["commits_per_write"] == {"1": 4} and shown["duplicate_commits"] == 0
    assert shown["runs_completed_per_host"] == {"h1": 2, "h2": 0}
    assert shown["takeovers_across_hosts"] == 1 and shown["lost_runs_continued_elsewhere"] == 1
    assert shown["time_to_complete_after_loss_s"]["by_loss"][0]["finished_on"] == {"r1": "h1"}
    assert shown["jobs_retried_on_server_kill"] == 1
    assert shown["operator_retries"] == {"refused: the run moved on": 1}


def test_a_write_committed_twice_or_unrecorded_or_missing_fails(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    evidence.branches["r1"].keys["r1-a"] = 2  # a second commit for one write
    verdicts = _git_verdicts(record, evidence)
    assert verdicts["each_write_one_commit"] == "fail"
    assert verdicts["server_kill_no_double_commit"] == "fail"
    assert git_figures(record, evidence)["duplicate_commits"] == 1
    record, evidence = _git_scene(tmp_path / "b")
    evidence.branches["r0"].keys["nobody-s-key"] = 1  # a commit the run never recorded
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"
    record, evidence = _git_scene(tmp_path / "c")
    del evidence.branches["r0"].keys["r0-b"]  # a recorded write with no commit
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"
    record, evidence = _git_scene(tmp_path / "d")
    evidence.branches["r0"].commit_of["r0-a"] = "another"  # the receipt names another commit
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"


def test_a_branch_off_its_last_write_foreign_or_unreadable_fails(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    evidence.branches["r1"].tip_tree = "t-c-r1-a"  # the content is not the last write's
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"
    record, evidence = _git_scene(tmp_path / "b")
    evidence.branches["r1"].foreign = ["f00d"]  # someone else's commit on the branch
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"
    record, evidence = _git_scene(tmp_path / "c")
    evidence.branches["r1"].error = "AdapterError: unreachable"
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"
    record, evidence = _git_scene(tmp_path / "d")
    evidence.branches["r0"].note = "run 0: step 1\n"  # completed, its note not the last one
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"
    # A cancelled run with no write recorded: its branch must still be its base.
    record, evidence = _git_scene(tmp_path / "e")
    evidence.runs["r0"].phase, evidence.runs["r0"].git_writes = "cancelled", []
    evidence.branches["r0"].keys.clear()
    evidence.branches["r0"].tip_tree = "t-base"
    record.cancels[0]["command"] = {"exit": 0}
    evidence.runs["r0-again"] = copy.deepcopy(evidence.runs["r1"])
    record.runs["r0-again"] = RunInfo("r0-again", 0, "h1", again_of="r0", submitted_host="h1")
    evidence.runs["r0-again"].remote["branch"] = "ratchet/r0-again"
    evidence.branches["r0-again"] = copy.deepcopy(evidence.branches["r1"])
    record.final["r0-again"] = ("terminal", "completed")
    evidence.runs["r0-again"].git_writes = evidence.runs["r1"].git_writes
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"  # r0-again's note
    evidence.branches["r0-again"].note = expected_note(0)
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "pass"
    evidence.branches["r0"].tip_tree = "t-other"
    assert _git_verdicts(record, evidence)["each_write_one_commit"] == "fail"


def test_a_run_bound_to_a_host_or_an_order_twice_fails(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    evidence.runs["r1"].document_host = "h2"
    assert _git_verdicts(record, evidence)["runs_complete_bound_to_no_host"] == "fail"
    record, evidence = _git_scene(tmp_path / "b")
    evidence.effects[1].orders["r1-o"] = 2
    assert _git_verdicts(record, evidence)["orders_exactly_once"] == "fail"
    record, evidence = _git_scene(tmp_path / "c")
    evidence.effects[0].orders["nobody-s-key"] = 1
    assert _git_verdicts(record, evidence)["orders_exactly_once"] == "fail"


def test_a_lost_host_s_run_that_waited_for_it_fails(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    record.terminal_at["r1"] = 31.0  # ended only once its host was back
    assert _git_verdicts(record, evidence)["lost_hosts_runs_continue_elsewhere"] == "fail"
    record, evidence = _git_scene(tmp_path / "b")
    evidence.events = [e for e in evidence.events if e["host"] != "h1" or e["run_id"] != "r1"]
    assert _git_verdicts(record, evidence)["lost_hosts_runs_continue_elsewhere"] == "fail"
    record, evidence = _git_scene(tmp_path / "c")
    evidence.events.append({"kind": "ack", "run_id": "r1", "at": 12.0, "host": "h2"})
    assert _git_verdicts(record, evidence)["lost_hosts_runs_continue_elsewhere"] == "fail"
    record, evidence = _git_scene(tmp_path / "d")
    evidence.runs["r1"].phase = "running"
    record.final["r1"] = ("active", "running")
    verdicts = _git_verdicts(record, evidence)
    assert verdicts["lost_hosts_runs_continue_elsewhere"] == "fail"
    assert verdicts["server_kill_no_double_commit"] == "fail"  # a run left unended
    assert verdicts["no_run_frozen"] == "fail"


def test_the_git_checker_says_unknown_when_nothing_happened(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    record.losses[0]["runs"] = {}  # the loss stranded no run: nothing to judge there
    assert _git_verdicts(record, evidence)["lost_hosts_runs_continue_elsewhere"] == "unknown"
    record, evidence = _git_scene(tmp_path / "b")
    record.losses, record.server_kills = [], []
    verdicts = _git_verdicts(record, evidence)
    assert verdicts["lost_hosts_runs_continue_elsewhere"] == "unknown"
    assert verdicts["server_kill_no_double_commit"] == "unknown"
    assert verdicts["every_fault_fired"] == "unknown"
    record, evidence = _git_scene(tmp_path / "c")
    record.server_kills[0]["pushes_in_flight"] = 0  # killed, but no push was in flight
    assert _git_verdicts(record, evidence)["every_fault_fired"] == "unknown"


def test_a_server_never_restarted_or_an_operator_move_gone_wrong_fails(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    del record.server_kills[0]["restarted_at"]
    assert _git_verdicts(record, evidence)["server_kill_no_double_commit"] == "fail"
    record, evidence = _git_scene(tmp_path / "b")
    record.losses[0]["commands"][0]["stderr"] = "ratchet: error: the store is down"
    assert _git_verdicts(record, evidence)["operator_paths_no_double_effect"] == "fail"
    record, evidence = _git_scene(tmp_path / "c")
    record.losses[0]["commands"][0].update(exit=0, stderr="")  # accepted: a record is due
    assert _git_verdicts(record, evidence)["operator_paths_no_double_effect"] == "fail"
    evidence.runs["r1"].incidents = [{"kind": "operator_retry", "at_ms": 11_000}]
    assert _git_verdicts(record, evidence)["operator_paths_no_double_effect"] == "pass"


def test_the_git_report_renders_for_a_person(tmp_path: Path) -> None:
    record, evidence = _git_scene(tmp_path)
    report = {
        "verdict": "pass",
        **git_figures(record, evidence),
        "options": record.options.as_dict(),
        "invariants": {i.name: i.as_dict() for i in judge_git(record, evidence)},
        "elapsed_s": 1.0,
    }
    console = Console(record=True, width=200)
    render_hosts(report, console)
    text = console.export_text()
    assert "commits_per_write" in text and "lost_hosts_runs_continue_elsewhere" in text
    assert "jobs_routed" not in text


def test_git_profile_options_are_checked() -> None:
    assert parse_host_faults("all", "git") == frozenset(GIT_HOST_FAULTS)
    assert parse_host_faults("kill,git-server-kill", "git") == {"kill", "git-server-kill"}
    for bad in ("rebaseline", "misroute", "kill,rebaseline,host-loss,host-return"):
        with pytest.raises(ConfigurationError):
            parse_host_faults(bad, "git")
    with pytest.raises(ConfigurationError):
        parse_host_faults("git-server-kill")  # the folder profile has no git server
    with pytest.raises(ConfigurationError):
        parse_host_faults("all", "svn")
    with pytest.raises(ConfigurationError):
        HostDrillOptions(faults=frozenset({"git-server-kill"})).check()
    with pytest.raises(ConfigurationError):
        HostDrillOptions(environment="git", faults=frozenset({"misroute"})).check()
    assert HostDrillOptions(environment="git").as_dict()["environment"] == "git"
    assert owner_host("drill-host-2-0a1b2c3d4e5f-123") == "drill-host-2"
    assert owner_host("") is None and owner_host("nohost") is None


def test_the_git_schedule_kills_at_the_push_not_the_journal() -> None:
    schedule = GitSchedule(7, frozenset({"kill"}), 8, repeats=1)
    points = {spec.split("=")[0] for spec in schedule.specs}
    assert {"git_before_push", "git_after_push"} <= points
    assert not {"workspace_after_intent", "workspace_after_replace"} & points


def test_environment_is_an_option_of_the_multi_host_drill_only() -> None:
    done = subprocess.run(
        [RATCHET, "drill", "--environment", "git", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--hosts 2 or more" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_drill_remote_holds_the_task_s_files_and_a_branch_reads_as_evidence(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "remote" / "drill.git"
    base = make_drill_remote(repo)
    with pytest.raises(ConfigurationError):
        make_drill_remote(repo)  # a used drill folder is refused, never overwritten
    url = repo.resolve().as_uri()
    document = git_document(url, "http://127.0.0.1:1/t/t0", 0, think_ms=0)
    assert document.environment.kind == "git" and document.environment.root is None
    found = read_branch("r0", {"url": url, "branch": "main", "base": base}, tmp_path / "c")
    assert found.error == "" and not found.keys and found.tip_tree == found.base_tree
    assert found.note == "draft\n"
    missing = read_branch("r0", {"url": url, "branch": "nope", "base": base}, tmp_path / "c")
    assert "missing" in missing.error


@needs_git
def test_the_git_server_is_killed_whole_and_comes_back_on_its_port(tmp_path: Path) -> None:
    repo = tmp_path / "remote" / "drill.git"
    base = make_drill_remote(repo)
    server = GitServer(repo)
    try:
        server.start()
        assert server.daemon and server.url.startswith("git://127.0.0.1:")
        branch = RemoteBranch(server.url, "main", cache=tmp_path / "cache")
        assert branch.tip() == base.encode()
        branch.close()
        assert server.pushes_in_flight() == []
        (repo / "refs" / "heads" / "stale.lock").write_text("")  # as a killed push leaves
        server.kill()
        assert not server.up and server.locks_removed == ["refs/heads/stale.lock"]
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), 1):
            pass
        port = server.port
        server.start()
        assert server.port == port and server.starts == 2
        again = RemoteBranch(server.url, "main", cache=tmp_path / "cache")
        assert again.tip() == base.encode()
        again.close()
    finally:
        server.kill()
