"""How the drill sees a run it watches (``classify_run``), on a real Redis and workspace.

A run that the last job to take it froze (the environment changed behind its pending
write) is settled as ``frozen``: nothing continues it until an operator acts, so the drill
must not wait for it until its duration runs out, and the checker then asks whether that
freeze was expected."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ratchet.chaos.drill.runner import classify_run
from ratchet.chaos.hooks import DrillHooks
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.ops import submit
from ratchet.runtime import CrashWindow
from ratchet.worker.job import execute_run
from tests.worker.conftest import fleet, redis_server, settings, workspace  # noqa: F401

Workspace = Callable[..., tuple[Path, RunDocument]]


def _freeze_mid_job(fleet: Fleet, workspace: Workspace) -> str:  # noqa: F811
    root, document = workspace()
    run_id = submit(fleet, document)
    edited: list[CrashWindow] = []

    def edit_once(window: CrashWindow) -> None:
        if window is CrashWindow.BEFORE_PROPOSAL and not edited:
            (root / "app.py").write_text("print('edited while the run was working')\n")
            edited.append(window)

    report = execute_run(fleet, run_id, owner="w-1", hooks=DrillHooks(probe=edit_once))
    if report.outcome != "environment_changed":
        raise AssertionError(report)
    return run_id


def test_a_run_its_last_job_froze_mid_job_is_settled_as_frozen(
    fleet: Fleet,  # noqa: F811
    workspace: Workspace,  # noqa: F811
) -> None:
    run_id = _freeze_mid_job(fleet, workspace)
    assert classify_run(fleet, run_id) == ("frozen", "running")


def test_a_freezing_incident_of_an_older_lease_does_not_settle_the_run(
    fleet: Fleet,  # noqa: F811
    workspace: Workspace,  # noqa: F811
) -> None:
    _root, document = workspace()
    run_id = submit(fleet, document)
    snap = fleet.store.read_run(run_id)
    fleet.store.records.record_incident(
        run_id,
        {
            "kind": "environment_changed",
            "reason": "stale_observation",
            "lease_version": snap.lease_version - 1,  # a job before the last one
        },
    )
    assert classify_run(fleet, run_id) == ("active", "running")
