"""The job, in one process, against a real Redis and a real workspace."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.chaos.failpoints import FailpointFired, Failpoints, parse_failpoints
from ratchet.chaos.hooks import DrillHooks
from ratchet.demo.examples import RIGHT_GREETING
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime import CrashWindow
from ratchet.runtime.effects import Effect, Hooks, RaiseFence
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def wait_for_expiry(fleet: Fleet, run_id: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not fleet.store.read_run(run_id).lease_live:
            return
        time.sleep(0.01)
    raise AssertionError("lease did not expire")


def test_a_submitted_run_is_executed_to_completion_with_one_write(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    report = execute_run(fleet, run_id, owner="w-1")
    assert (report.outcome, report.phase) == ("finished", "completed")
    assert (root / "app.py").read_text() == RIGHT_GREETING
    assert effects(root) == 1
    view = inspect_run(fleet, run_id)
    assert view.state.phase.value == "completed"
    assert not fleet.store.read_run(run_id).lease_live  # released


def test_a_terminal_run_is_never_re_executed(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    execute_run(fleet, run_id, owner="w-1")
    generation = fleet.store.read_run(run_id).generation
    again = execute_run(fleet, run_id, owner="w-2")
    assert again.outcome == "terminal"
    assert fleet.store.read_run(run_id).generation == generation
    assert effects(root) == 1


@pytest.mark.parametrize(
    "window",
    [
        CrashWindow.AFTER_PENDING_BEFORE_ADAPTER,
        CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT,
        CrashWindow.AFTER_RECEIPT_BEFORE_STATE,
    ],
)
def test_a_job_that_dies_in_a_window_is_finished_by_the_next_owner_with_one_write(
    fleet: Fleet,
    workspace: Callable[..., tuple[Path, RunDocument]],
    window: CrashWindow,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    points = f"{window.value}=raise"
    if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
        # The receipt is committed apart from the state only when the environment cannot
        # be observed right after the write: play that for the first owner.
        points += ";observe_after_write=raise"
    probe = Failpoints(parse_failpoints(points))
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-1", hooks=DrillHooks(probe))
    held = execute_run(fleet, run_id, owner="w-2")
    assert held.outcome == "held_elsewhere"  # the dead owner's lease still runs
    wait_for_expiry(fleet, run_id)
    report = execute_run(fleet, run_id, owner="w-2")
    assert (report.outcome, report.phase) == ("finished", "completed")
    assert report.windows == [window.value]
    assert effects(root) == 1
    assert (root / "app.py").read_text() == RIGHT_GREETING


def test_a_file_edited_behind_ratchets_back_fails_closed_with_a_visible_reason(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    from ratchet.worker.reaper import reap_once

    root, document = workspace()
    run_id = submit(fleet, document)
    (root / "app.py").write_text("print('edited by someone else')\n")
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.outcome == "restore_refused"
    assert report.detail.startswith("environment")
    view = inspect_run(fleet, run_id)
    assert view.incidents[0]["reason"] == "environment"
    assert view.state.phase.value == "running"  # the last trusted state, untouched
    assert not fleet.store.read_run(run_id).lease_live
    assert effects(root) == 0
    enqueued: list[str] = []
    reap_once(fleet.store, enqueued.append)
    assert run_id not in enqueued  # no retry loop: an operator has to look


def test_a_file_edited_mid_job_stops_the_write_and_freezes_the_run_with_the_reason(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    """The workspace's version does not move when a file is edited on disk; the engine's
    live check before the write sees the fingerprint change, sends nothing, and the job
    records why and leaves the run for an operator."""
    from ratchet.worker.reaper import reap_once

    root, document = workspace()
    run_id = submit(fleet, document)
    edit = "print('edited while the run was working')\n"
    edited: list[CrashWindow] = []

    def edit_once(window: CrashWindow) -> None:
        if window is CrashWindow.BEFORE_PROPOSAL and not edited:
            (root / "app.py").write_text(edit)
            edited.append(window)

    report = execute_run(fleet, run_id, owner="w-1", hooks=DrillHooks(probe=edit_once))
    assert report.outcome == "environment_changed"
    assert report.detail.startswith("stale_observation")
    view = inspect_run(fleet, run_id)
    incident = view.incidents[0]
    assert (incident["kind"], incident["reason"]) == ("environment_changed", "stale_observation")
    assert incident["evidence"]["fingerprint_changed"] is True
    assert view.state.pending is not None  # kept as evidence, never sent
    assert effects(root) == 0
    assert (root / "app.py").read_text() == edit
    assert not fleet.store.read_run(run_id).lease_live
    enqueued: list[str] = []
    reap_once(fleet.store, enqueued.append)
    assert run_id not in enqueued


def test_a_broken_environment_is_refused_once_not_retried_forever(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    import shutil

    root, document = workspace()
    run_id = submit(fleet, document)
    shutil.rmtree(root)
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.outcome == "restore_refused"
    assert inspect_run(fleet, run_id).incidents
    assert not fleet.store.read_run(run_id).lease_live


def test_a_key_conflict_waits_for_review_and_a_signed_replan_completes_the_run(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]], tmp_path: Path
) -> None:
    import json as _json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from ratchet.demo.examples import RIGHT_GREETING as FIX
    from ratchet.fleet.context import Fleet as FleetClass
    from ratchet.ops import review
    from ratchet.runtime import Fence, derive_idempotency_key, parse_action

    reviewer = Ed25519PrivateKey.generate()
    trust = tmp_path / "reviewers.json"
    trust.write_text(
        _json.dumps(
            {"rita": reviewer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()}
        )
    )
    fleet = FleetClass.connect(fleet.settings.model_copy(update={"reviewers_file": trust}))
    root, document = workspace()
    plan = [
        {"kind": "write_file", "args": {"path": "app.py", "content": FIX}},
        {"kind": "run_verifier", "args": {"target": "unit"}},
        {"kind": "finish", "args": {"summary": "fixed"}},
    ]
    document = document.model_copy(update={"agent": "scripted", "agent_config": {"steps": plan}})
    run_id = "r-conflict-1"
    key = derive_idempotency_key(run_id, 0, salt="0")
    # Another caller already used the key the run will derive, for another intent.
    with WorkspaceAdapter(root, ["app.py"]) as other:
        foreign = parse_action(
            {
                "action_id": "x-1",
                "kind": "write_file",
                "risk": "reversible_write",
                "args": {"path": "app.py", "content": "print('other')\n"},
                "idempotency_key": key,
                "expected_env_version": other.observe().version,
                "deadline_at": 2**40,
            }
        )
        other.execute(
            foreign,
            foreign.intent_digest,
            Fence(run_id="someone-else", lease_version=1, state_version=1),
            None,
        )
    submit(fleet, document, run_id=run_id)
    first = execute_run(fleet, run_id, owner="w-1")
    assert (first.outcome, first.phase) == ("waiting", "needs_review")
    case = inspect_run(fleet, run_id).state.review
    assert case is not None and case.reason.value == "intent_conflict"
    assert effects(root) == 1  # only the foreign write
    review(fleet, run_id, "replan", key=reviewer, reviewer_id="rita")
    second = execute_run(fleet, run_id, owner="w-2")
    assert (second.outcome, second.phase) == ("finished", "completed")
    state = inspect_run(fleet, run_id).state
    assert key in state.quarantined_keys
    assert state.closed_reviews[-1].decision is not None
    assert (root / "app.py").read_text() == FIX
    assert effects(root) == 2  # the foreign write and the run's own, once each


def _git(root: Path, *args: str) -> None:
    import subprocess

    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=root,
        check=True,
        capture_output=True,
        timeout=30,
    )


def test_a_moved_git_head_fails_closed_with_a_visible_reason(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root, document = workspace()
    _git(root, "init", "-q")
    _git(root, "add", "app.py", "test_app.py")
    _git(root, "commit", "-q", "-m", "base")
    run_id = submit(fleet, document)
    (root / "NOTES").write_text("another commit\n")
    _git(root, "add", "NOTES")
    _git(root, "commit", "-q", "-m", "someone moved HEAD")
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.outcome == "restore_refused"
    assert inspect_run(fleet, run_id).incidents[0]["reason"] == "environment"
    assert effects(root) == 0


def test_a_reset_workspace_is_another_instance_and_fails_closed(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    import shutil

    root, document = workspace()
    run_id = submit(fleet, document)
    shutil.rmtree(root / ".ratchet")  # journal and instance id gone: a new environment
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.outcome == "restore_refused"
    incident = inspect_run(fleet, run_id).incidents[0]
    assert incident["reason"] == "environment"
    assert "instance" in incident["message"]


class _TakeoverBeforeTheRestoresFence(WorkerHooks):
    """After the guard let the restore's fence go and before it reaches the workspace, the
    job stalls past its lease (the heartbeat stops renewing a job that makes no progress);
    another owner takes the run over and raises its own fence at the workspace."""

    def __init__(self, fleet: Fleet, root: Path) -> None:
        self.fleet, self.root = fleet, root
        self.successor: Any = None

    def job(self, lease: Any, lease_gone: Callable[[], bool]) -> Hooks | None:
        outer = self

        class Around(Hooks):
            def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
                if isinstance(effect, RaiseFence) and outer.successor is None:
                    wait_for_expiry(outer.fleet, lease.run_id)
                    outer.successor = outer.fleet.store.acquire(
                        lease.run_id, owner="w-2", ttl_ms=30_000
                    )
                    with WorkspaceAdapter(outer.root, ["app.py"]) as ws:
                        ws.raise_fence(outer.successor.fence)
                return proceed()

        return Around()


def test_a_restore_whose_fence_a_new_owner_outranked_ends_lease_lost_without_an_incident(
    settings: Settings, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    """The workspace refuses the stalled job's fence because a newer owner holds the run:
    that is a lost lease, not a run to freeze; the run has no incident and stays on the
    new owner's lease."""
    fleet = Fleet.connect(settings.model_copy(update={"stall_timeout_ms": 400}))
    root, document = workspace()
    run_id = submit(fleet, document)
    hooks = _TakeoverBeforeTheRestoresFence(fleet, root)
    report = execute_run(fleet, run_id, owner="w-1", hooks=hooks)
    assert hooks.successor is not None
    view = inspect_run(fleet, run_id)
    assert view.incidents == []
    assert (report.outcome, report.detail) == ("lease_lost", "FenceRejectedError")
    assert fleet.store.read_run(run_id).is_held_by("w-2", hooks.successor.lease_version)
    assert effects(root) == 0


def test_a_journal_locked_past_the_busy_timeout_ends_the_job_retry_later_not_poisoned(
    settings: Settings, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    """Another process holds the workspace journal's lock while the job writes: the job
    ends ``retry_later`` (its lease left to expire, no incident, nothing written), and the
    next job, once the lock is gone, writes once. Without the typed error SQLite's own
    ``OperationalError`` ended the job as a ``job_error`` and, repeated, froze the run."""
    import sqlite3

    fleet = Fleet.connect(settings.model_copy(update={"workspace_busy_timeout_ms": 100}))
    root, document = workspace()
    run_id = submit(fleet, document)
    held: list[sqlite3.Connection] = []

    def lock_once(window: CrashWindow) -> None:
        if window is CrashWindow.BEFORE_PROPOSAL and not held:
            other = sqlite3.connect(root / ".ratchet" / "journal.sqlite3", isolation_level=None)
            other.execute("BEGIN EXCLUSIVE")
            held.append(other)

    try:
        report = execute_run(fleet, run_id, owner="w-1", hooks=DrillHooks(probe=lock_once))
    finally:
        for other in held:
            other.rollback()
            other.close()
    assert held, "the probe never reached the first proposal"
    assert (report.outcome, report.detail) == ("retry_later", "workspace journal failed")
    assert inspect_run(fleet, run_id).incidents == []
    assert effects(root) == 0
    wait_for_expiry(fleet, run_id)
    again = execute_run(fleet, run_id, owner="w-2")
    assert (again.outcome, again.phase) == ("finished", "completed")
    assert effects(root) == 1
    assert (root / "app.py").read_text() == RIGHT_GREETING


@pytest.mark.parametrize("stage", ["workspace_after_intent", "workspace_after_replace"])
def test_a_job_dying_inside_the_workspace_write_is_settled_by_the_next_owner_once(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]], stage: str
) -> None:
    """The worker dies inside the adapter's write (the journal holds the intent; the file
    is or is not replaced yet): the next owner's first workspace call settles the intent
    from the file, and the run completes with its one write."""
    import sqlite3

    root, document = workspace()
    run_id = submit(fleet, document)
    probe = Failpoints(parse_failpoints(f"{stage}=raise@1"))
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-1", hooks=DrillHooks(probe))
    with sqlite3.connect(root / ".ratchet" / "journal.sqlite3") as db:
        assert db.execute("SELECT status FROM writes").fetchall() == [("intent",)]
    replaced = (root / "app.py").read_text() == RIGHT_GREETING
    assert replaced is (stage == "workspace_after_replace")
    wait_for_expiry(fleet, run_id)
    report = execute_run(fleet, run_id, owner="w-2")
    assert (report.outcome, report.phase) == ("finished", "completed")
    assert effects(root) == 1
    with sqlite3.connect(root / ".ratchet" / "journal.sqlite3") as db:
        statuses = sorted(s for (s,) in db.execute("SELECT status FROM writes"))
    # Not replaced: the intent was aborted and the write sent again under its key (the
    # row reused); replaced: recovery wrote the receipt and the lookup found it.
    assert statuses == ["committed"]
    assert (root / "app.py").read_text() == RIGHT_GREETING
