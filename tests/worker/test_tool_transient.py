"""Transient is not configuration: a run whose tool package cannot reach its server at
job start is retried later, not frozen, and completes once the server is back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Scenario
from ratchet.worker.job import execute_run
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow


def test_a_tool_whose_server_is_down_at_job_start_retries_the_job_and_never_freezes(
    fleet: Fleet,
    workspace: Callable[..., Any],
    installed: Path,
) -> None:
    _, plain = workspace(runner="python")
    data = plain.scenario.model_dump(mode="json")
    scenario = Scenario.model_validate(
        {**data, "permissions": [*data["permissions"], "flaky_status"]}
    )
    run_id = submit(fleet, plain.model_copy(update={"scenario": scenario}), run_id="r-flaky")
    down = sys.modules["refund_plugin"].DOWN
    down.append(True)
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.outcome == "retry_later", report
    assert "flaky_status" in report.detail and "retried later" in report.detail
    view = inspect_run(fleet, run_id)
    assert view.state.phase.value == "running"
    assert not [i for i in view.incidents if i.get("kind") == "restore_refused"]
    down.clear()
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    report = execute_run(fleet, run_id, owner="w-2")
    assert report.phase == "completed", report
