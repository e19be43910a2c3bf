"""The job, in one process, against a real Redis and a real workspace."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.runtime import CrashWindow
from ratchet.worker.context import Fleet
from ratchet.worker.examples import RIGHT_GREETING
from ratchet.worker.failpoints import FailpointFired, Failpoints, parse_failpoints
from ratchet.worker.job import execute_run
from ratchet.worker.ops import inspect_run, submit
from ratchet.worker.runs import RunDocument


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


@pytest.mark.parametrize("window", [
    CrashWindow.AFTER_PENDING_BEFORE_ADAPTER,
    CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT,
    CrashWindow.AFTER_RECEIPT_BEFORE_STATE,
])
def test_a_job_that_dies_in_a_window_is_finished_by_the_next_owner_with_one_write(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]], window: CrashWindow
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    probe = Failpoints(parse_failpoints(f"{window.value}=raise"))
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-1", probe=probe)
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
