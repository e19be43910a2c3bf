"""Workspace faults in `ratchet drill`: a journal locked by another process and the
workspaces' disk full. Each invariant on synthetic evidence (pass, fail, unknown), the
fault's own mechanics on a real workspace, and, opt-in, a short drill of both."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ratchet.adapters import WorkspaceAdapter
from ratchet.chaos.drill import workspacefaults
from ratchet.chaos.drill.evidence import AdapterRecords, Evidence, RunFacts
from ratchet.chaos.drill.schedule import FAULTS, parse_faults
from ratchet.chaos.drill.services import NOTE, expected_note, make_workspace
from ratchet.chaos.drill.workspacechecks import workspace_fired, workspace_invariants
from ratchet.chaos.drill.workspacefaults import (
    WORKSPACE_FAULTS,
    WorkspaceFaults,
    job_ends,
    met_the_fault,
    retried,
)
from ratchet.errors import AdapterError
from ratchet.runtime import Fence
from tests.chaos.drill_support import drill_record as record

RATCHET = str(Path(sys.executable).with_name("ratchet"))


def facts(
    run_id: str,
    index: int = 0,
    *,
    phase: str = "completed",
    note: str | None = None,
    writes: int = 2,
    check: str = "ok",
    unresolved: int = 0,
) -> RunFacts:
    adapters = AdapterRecords(
        file_effects={f"w{i}": 1 for i in range(writes)},
        receipt_keys={f"k{i}" for i in range(writes)},
        journal_check=check,
        note=expected_note(index) if note is None else note,
        unresolved=unresolved,
    )
    status = "terminal" if phase == "completed" else "active"
    keys = {f"k{i}" for i in range(writes)}
    return RunFacts(run_id, index, status, phase, 6, [], keys, None, [], adapters)


def job_end(run_id: str, at: float, outcome: str, detail: str, **fields: Any) -> dict[str, Any]:
    return {
        "kind": "job_end",
        "run_id": run_id,
        "lease_version": 7,
        "pid": 100,
        "at": at,
        "outcome": outcome,
        "detail": detail,
        **fields,
    }


def fault(kind: str = "sqlite-busy", **fields: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "at": 10.0,
        "ended_at": 13.0,
        "hold_s": 3.0,
        "run_id": "r1",
        "index": 0,
        "lease_version": 7,
        "live_runs": ["r1", "r2"],
        **fields,
    }


def judged(rec: Any, ev: Evidence) -> dict[str, Any]:
    return {i.name: i for i in workspace_invariants(rec, ev)}


MET = job_end("r1", 11.5, "retry_later", "workspace journal failed")


# -- the fault list -------------------------------------------------------------------------


def test_every_workspace_fault_is_a_drill_fault_and_all_includes_it() -> None:
    assert set(WORKSPACE_FAULTS) <= set(FAULTS)
    assert set(WORKSPACE_FAULTS) <= parse_faults("all")


def test_a_job_met_the_fault_only_when_it_ended_retry_later_on_the_workspace() -> None:
    assert met_the_fault(MET)
    assert met_the_fault(job_end("r1", 1, "retry_later", "workspace write failed"))
    assert not met_the_fault(job_end("r1", 1, "retry_later", "service unreachable"))
    assert not met_the_fault(job_end("r1", 1, "job_error", "workspace journal failed"))
    # Met it, the wrong way: SQLite's own error ended the job as a job error.
    raw = job_end("r1", 1, "job_error", "OperationalError: database is locked")
    assert met_the_fault(raw) and not retried(raw)


# -- the invariants on synthetic evidence ----------------------------------------------------


def test_a_locked_journal_a_job_met_and_a_run_that_completed_once_pass(tmp_path: Path) -> None:
    rec = record(tmp_path, workspace_faults=[fault()])
    ev = Evidence([], {"job_end": [MET]}, {"r1": facts("r1"), "r2": facts("r2", 1)})
    verdict = judged(rec, ev)["busy_journal_retried"]
    assert verdict.status == "pass", verdict.detail
    assert workspace_fired(rec, ev)["sqlite-busy"] == 1


def test_a_storage_failure_ending_a_job_as_a_job_error_fails(tmp_path: Path) -> None:
    """What the journal did before its errors were typed: SQLite's own error ended the
    job as a job error (and, repeated, froze the run as poisoned)."""
    rec = record(tmp_path, workspace_faults=[fault()])
    poisoned = job_end("r1", 12.0, "job_error", "OperationalError: database is locked")
    for ends in ([MET, poisoned], [poisoned]):  # also when no job was retried at all
        ev = Evidence([], {"job_end": ends}, {"r1": facts("r1")})
        verdict = judged(rec, ev)["busy_journal_retried"]
        assert verdict.status == "fail"
        assert "ended job_error on storage" in verdict.detail


@pytest.mark.parametrize(
    ("run", "problem"),
    [
        (facts("r1", note="run 0: step 1\n"), "completed with its note"),
        (facts("r1", writes=3), "completed with 3 writes"),
        (facts("r1", check="*** in database main ***"), "journal check"),
        (facts("r1", phase="running", unresolved=1), "writes unresolved"),
        (facts("r1", phase="running"), "unsettled"),
    ],
)
def test_a_run_the_fault_met_that_lost_or_doubled_a_write_or_never_settled_fails(
    tmp_path: Path, run: RunFacts, problem: str
) -> None:
    rec = record(tmp_path, workspace_faults=[fault()])
    verdict = judged(rec, Evidence([], {"job_end": [MET]}, {"r1": run}))["busy_journal_retried"]
    assert verdict.status == "fail"
    assert problem in verdict.detail


def test_a_fault_no_job_met_is_unknown_and_not_counted_as_fired(tmp_path: Path) -> None:
    rec = record(tmp_path, workspace_faults=[fault()])
    late = job_end("r1", 30.0, "retry_later", "workspace journal failed")  # after the grace
    other = job_end("r2", 11.0, "retry_later", "workspace journal failed")  # another run
    ev = Evidence([], {"job_end": [late, other]}, {"r1": facts("r1")})
    assert judged(rec, ev)["busy_journal_retried"].status == "unknown"
    assert workspace_fired(rec, ev)["sqlite-busy"] == 0


def test_a_full_disk_judges_every_run_live_at_the_fill_and_every_run_a_job_met(
    tmp_path: Path,
) -> None:
    rec = record(
        tmp_path, runs={"r1": 0, "r2": 1, "r3": 2}, workspace_faults=[fault("workspace-full")]
    )
    met_r3 = job_end("r3", 12.0, "retry_later", "workspace write failed")
    runs = {"r1": facts("r1"), "r2": facts("r2", 1, note="draft\n"), "r3": facts("r3", 2)}
    verdict = judged(rec, Evidence([], {"job_end": [met_r3]}, runs))
    full = verdict["full_workspace_no_effect_lost"]
    assert full.status == "fail"  # r2 was live at the fill: judged too
    assert "r2: completed with its note" in full.detail
    runs["r2"] = facts("r2", 1)
    assert (
        judged(rec, Evidence([], {"job_end": [met_r3]}, runs))[
            "full_workspace_no_effect_lost"
        ].status
        == "pass"
    )


def test_a_skipped_full_disk_says_why(tmp_path: Path) -> None:
    why = "not running as root: the workspaces' disk cannot be mounted small and filled"
    rec = record(tmp_path, workspace_skipped={"workspace-full": why})
    verdict = judged(rec, Evidence([], {}, {}))["full_workspace_no_effect_lost"]
    assert verdict.status == "unknown" and why in verdict.detail


def test_job_ends_reads_the_event_logs_within_the_window(tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    lines = [
        json.dumps(job_end("r1", 5.0, "retry_later", "workspace journal failed")),
        json.dumps(MET),
        json.dumps({"kind": "acquire", "run_id": "r1", "at": 11.0}),
        '{"kind": "job_end", "cut by a kill',
    ]
    (events / "events-100.jsonl").write_text("\n".join(lines))
    assert job_ends(events, 10.0, 14.0) == [MET]


# -- the faults' mechanics on a real workspace ------------------------------------------------


class _Rec:
    def __init__(self, folder: Path) -> None:
        self.corrupted: dict[str, Any] = {}
        self.events_dir = folder / "events"
        self.events_dir.mkdir(parents=True, exist_ok=True)


class _Drill:
    """What WorkspaceFaults reads of the runner's drill: one run, r0, unsettled, whose
    lease 7 a running worker (pid 100) acquired."""

    def __init__(self, folder: Path) -> None:
        import random

        self.rec = _Rec(folder)
        acquire = {"kind": "acquire", "run_id": "r0", "lease_version": 7, "pid": 100, "at": 1.0}
        (self.rec.events_dir / "events-100.jsonl").write_text(json.dumps(acquire) + "\n")
        worker = SimpleNamespace(pid=100, paused_at=None, proc=SimpleNamespace(exitcode=None))
        self.pool = SimpleNamespace(workers={100: worker})
        self.index = {"r0": 0}
        self.rng = random.Random(1)
        self.pending: list[str] = []
        self.injecting = True
        self.net: Any = None
        # Only its client is read, and only by the lease snapshot the tests replace.
        self.fleet = SimpleNamespace(store=SimpleNamespace(client=None))

    def unsettled(self) -> set[str]:
        return {"r0"}


def _live(monkeypatch: pytest.MonkeyPatch) -> None:
    """r0's lease is live (what Redis would answer; the store is not under test here)."""

    def snapshot(client: Any, runs: list[str]) -> list[dict[str, Any]]:
        return [{"run_id": r, "lease_version": 7, "generation": 2} for r in runs]

    monkeypatch.setattr(workspacefaults, "lease_snapshot", snapshot)


def _write(ws: WorkspaceAdapter, content: str) -> None:
    from ratchet.runtime import Action

    action = Action.model_validate(
        {
            "action_id": "a-1",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": NOTE, "content": content},
            "idempotency_key": "k-1",
            "expected_env_version": ws.observe().version,
            "deadline_at": 2**40,
        }
    )
    ws.execute(
        action, action.intent_digest, Fence(run_id="r0", lease_version=7, state_version=1), None
    )


def test_sqlite_busy_holds_the_runs_journal_then_lets_the_write_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _live(monkeypatch)
    faults = WorkspaceFaults(frozenset({"sqlite-busy"}), tmp_path, ttl_s=0.1)
    root = make_workspace(faults.root / "ws-0")
    drill = _Drill(tmp_path)
    with WorkspaceAdapter(root, [NOTE], busy_timeout_s=0.1) as ws:
        faults.tick(drill, 100.0, 0.5)
        held = faults.active
        assert held is not None and faults.lock is not None
        assert (held["run_id"], held["pid"]) == ("r0", 100)
        with pytest.raises(AdapterError) as busy:
            _write(ws, "run 0: step 1\n")
        assert busy.value.context["error"] == "SQLITE_BUSY"
        faults.tick(drill, held["at"] + held["hold_s"], 0.5)  # held long enough: released
        assert "ended_at" in held and faults.lock is None and faults.active is None
        assert faults.grading == [held] and faults.pending
        _write(ws, "run 0: step 1\n")
        assert ws.effects == 1
    # Once the grace has passed, the fault is recorded with the jobs that met it (none
    # logged here) and tried again, at most twice, on another run (r0 is the only one).
    faults.tick(drill, held["ended_at"] + 10.0, 0.5)
    assert faults.faults == [held] and held["jobs_met"] == []
    assert faults.wanted == [("sqlite-busy", 0.0)] and faults.active is None
    assert faults.lock is None
    faults.end()
    assert faults.faults == [held] and not faults.pending
    assert faults.skipped == {"sqlite-busy": "injection ended before it was due"}


def test_a_lease_whose_worker_died_or_is_paused_is_no_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed worker's lease stays live until it expires: locking its run's journal
    then would only meet the next job at its start, never a job mid-run."""
    _live(monkeypatch)
    faults = WorkspaceFaults(frozenset({"sqlite-busy"}), tmp_path, ttl_s=0.1)
    make_workspace(faults.root / "ws-0")
    drill = _Drill(tmp_path)
    assert [t["pid"] for t in faults.targets(drill)] == [100]
    drill.pool.workers[100].proc.exitcode = -9
    assert faults.targets(drill) == []
    drill.pool.workers[100].proc.exitcode = None
    drill.pool.workers[100].paused_at = 5.0
    assert faults.targets(drill) == []
    drill.pool.workers[100].paused_at = None
    # Its job is held up at the orders service (the link cut): not calling the workspace.
    cut = {"kind": "partition-adapter", "run_id": "r0"}
    drill.net = SimpleNamespace(lanes={"redis": None, "orders": cut})
    assert faults.targets(drill) == []
    drill.net = None
    assert [t["pid"] for t in faults.targets(drill)] == [100]
    # A run this fault already held with no job meeting it is not tried again.
    faults.faults.append({"kind": "sqlite-busy", "run_id": "r0", "jobs_met": []})
    assert faults.targets(drill) == []


def test_workspace_full_fills_the_workspaces_disk_then_frees_it_and_keeps_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the workspaces' tmpfs needs root")
    _live(monkeypatch)
    faults = WorkspaceFaults(frozenset({"workspace-full"}), tmp_path, ttl_s=0.1)
    faults.mount()
    try:
        assert faults.disk is not None and faults.disk.mounted, faults.skipped
        root = make_workspace(faults.root / "ws-0")
        drill = _Drill(tmp_path)
        with WorkspaceAdapter(root, [NOTE]) as ws:
            faults.tick(drill, 100.0, 0.5)
            held = faults.active
            assert held is not None and held["filler_bytes"] > 0
            with pytest.raises(AdapterError) as full:
                _write(ws, "x" * 600_000)
            assert full.value.retryable is True
            faults.tick(drill, held["at"] + held["hold_s"], 0.5)
            assert "ended_at" in held and faults.active is None
            _write(ws, "x" * 600_000)
            assert ws.effects == 1
    finally:
        faults.close()
    assert faults.disk is not None and not faults.disk.mounted
    assert (tmp_path / "workspaces" / "ws-0" / NOTE).read_text() == "x" * 600_000


def test_a_held_fault_is_released_even_when_every_tick_of_the_drill_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release runs ahead of the drill's tick, in its own guard: a tick that keeps
    failing (Redis down) cannot keep the journal locked; the tick's error is recorded with
    its message."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from ratchet.chaos.drill.runner import _Drill as Runner

    _live(monkeypatch)
    faults = WorkspaceFaults(frozenset({"sqlite-busy"}), tmp_path, ttl_s=0.1)
    with WorkspaceAdapter(make_workspace(faults.root / "ws-0"), [NOTE]):
        pass  # the run's journal made
    faults.tick(_Drill(tmp_path), 100.0, 0.5)
    held = faults.active
    assert held is not None and faults.lock is not None
    held["at"] -= held["hold_s"]  # held long enough by now

    def failing_tick() -> None:
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    runner = SimpleNamespace(
        ws=faults,
        tick=failing_tick,
        rec=SimpleNamespace(errors=[]),
        quick_deaths=0,
        o=SimpleNamespace(workers=3),
    )
    Runner.guarded_tick(runner)  # type: ignore[arg-type]
    assert faults.active is None and faults.lock is None and faults.grading == [held]
    assert runner.rec.errors == [
        "tick: ConnectionError: Error 111 connecting to 127.0.0.1:1. Connection refused."
    ]


def test_a_release_that_fails_keeps_the_fault_in_force_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tmpfs whose size does not come back is no release: the fault stays in force (the
    next tick tries again), the failure is recorded with its message, and at the end the
    failed release is in the fault kinds' errors."""
    from ratchet.chaos.drill.runner import _Drill as Runner
    from ratchet.chaos.drill.storefaults import Tmpfs

    class StuckDisk(Tmpfs):
        def free(self) -> None:
            raise OSError("tmpfs at /w is 2048 KiB after the remount, not 262144 KiB")

    _live(monkeypatch)
    faults = WorkspaceFaults(frozenset({"workspace-full"}), tmp_path, ttl_s=0.1)
    faults.disk = StuckDisk(tmp_path / "w")
    faults.active = {"kind": "workspace-full", "at": 0.0, "hold_s": 1.0, "run_id": "r0"}
    runner = SimpleNamespace(
        ws=faults,
        tick=lambda: None,
        rec=SimpleNamespace(errors=[]),
        quick_deaths=0,
        o=SimpleNamespace(workers=3),
    )
    Runner.guarded_tick(runner)  # type: ignore[arg-type]
    assert faults.active is not None and faults.grading == []
    assert runner.rec.errors == [
        "workspace release: OSError: tmpfs at /w is 2048 KiB after the remount, not 262144 KiB"
    ]
    faults.end()
    assert faults.errors == [
        "release workspace-full: tmpfs at /w is 2048 KiB after the remount, not 262144 KiB"
    ]
    assert [f["kind"] for f in faults.faults] == ["workspace-full"]


def test_a_tmpfs_whose_size_did_not_come_back_is_not_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the tmpfs needs root")
    from ratchet.chaos.drill.storefaults import Tmpfs

    disk = Tmpfs(tmp_path / "disk", size_mb=8, what="a test disk")
    assert disk.mount() is None
    try:
        (disk.point / "kept").write_bytes(b"k" * 4096)
        assert disk.fill() > 0
        real = disk._mount
        monkeypatch.setattr(disk, "_mount", lambda *options: None)  # a remount that did nothing
        with pytest.raises(OSError, match="after the remount, not 8192 KiB"):
            disk.free()
        monkeypatch.setattr(disk, "_mount", real)
        disk.free()
        st = os.statvfs(disk.point)
        assert st.f_bavail * st.f_frsize > 4 * 1024 * 1024
        assert (disk.point / "kept").read_bytes() == b"k" * 4096
    finally:
        disk.unmount()
    assert not disk.mounted


# -- a short drill of both -------------------------------------------------------------------


# The CI profile (tests/chaos/test_drill.py) fires both and requires their invariants to
# pass; this drill of the workspace faults alone is opt-in.
@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_a_short_drill_of_the_workspace_faults_passes(tmp_path: Path) -> None:
    folder = tmp_path / "drill"
    shutil.rmtree(folder, ignore_errors=True)
    kinds = ",".join(k for k in WORKSPACE_FAULTS if os.geteuid() == 0 or k != "workspace-full")
    args = ["--workers", "3", "--runs", "12", "--lease-ttl", "1", "--faults", f"kill,{kinds}"]
    done = subprocess.run(
        [RATCHET, "drill", *args, "--json", "--dir", str(folder)],
        capture_output=True,
        timeout=400,
        check=False,
        env=dict(os.environ),
    )
    assert done.stdout, done.stderr.decode(errors="replace")[-2000:]
    report = json.loads(done.stdout)
    invariants = report["invariants"]
    names = ["busy_journal_retried", "one_effect_per_intent", "no_run_stuck", "every_fault_fired"]
    if os.geteuid() == 0:
        names.append("full_workspace_no_effect_lost")
    for name in names:
        assert invariants[name]["status"] == "pass", (name, invariants[name])
    assert not report["failed_invariants"], report["failed_invariants"]


def _mounts_under(folder: Path) -> list[str]:
    with open("/proc/self/mounts") as fh:
        return [line.split()[1] for line in fh if line.split()[1].startswith(str(folder))]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_drill_stopped_with_sigterm_unmounts_what_it_mounted(tmp_path: Path) -> None:
    """SIGTERM (what a CI runner or a test's timeout sends) stops a drill the way Ctrl-C
    does: its tmpfs mounts (Redis' folder, the workspaces) are gone when it exits."""
    if os.geteuid() != 0:
        pytest.skip("the drill's tmpfs mounts need root")
    import signal
    import time

    folder = tmp_path / "drill"
    args = ["--workers", "2", "--runs", "6", "--faults", "workspace-full,disk-full", "--json"]
    proc = subprocess.Popen(
        [RATCHET, "drill", *args, "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_mounts_under(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_mounts_under(folder)) == 2, "the drill never mounted its two tmpfs"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        for point in _mounts_under(folder):
            subprocess.run(["umount", "-l", point], check=False)
    assert _mounts_under(folder) == []


def test_the_checker_reads_a_journal_it_cannot_recover_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal whose lock is still held when the checker reads it: the drill does not
    crash on it (it did, with ``workspace journal cannot be opened``); the file is read as
    it is and its check says it was not recovered."""
    import sqlite3

    from ratchet.chaos.drill import evidence

    monkeypatch.setattr(evidence, "EVIDENCE_BUSY_S", 0.2)
    root = make_workspace(tmp_path / "ws-0")
    with WorkspaceAdapter(root, [NOTE]) as ws:
        _write(ws, "run 0: step 1\n")
    other = sqlite3.connect(root / ".ratchet" / "journal.sqlite3", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        records = AdapterRecords()
        why = evidence.read_workspace(root, records)
    finally:
        other.rollback()
        other.close()
    assert why is not None and "SQLITE_BUSY" in why
    assert records.journal_check.startswith("not recovered")
    assert sum(records.file_effects.values()) == 1 and records.note == "run 0: step 1\n"
    fresh = AdapterRecords()
    assert evidence.read_workspace(root, fresh) is None and fresh.journal_check == "ok"
