"""Poison runs stop: a job that fails for any reason but a lost lease or fence records an
incident, gives its lease up and is retried after a backoff, up to a budget; then the run
is frozen with the reason visible, never crash-looping through the reaper."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.leasing import EXPIRY_INDEX
from ratchet.ops import submit
from ratchet.worker.job import execute_run

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]


def test_a_run_whose_agent_raises_is_retried_with_backoff_then_frozen(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    allowing = Fleet.connect(
        fleet.settings.model_copy(
            update={"agents": ("tests.worker",), "max_job_errors": 3, "job_error_backoff_ms": 1000}
        )
    )
    root, document = workspace()
    run_id = submit(
        allowing, document.model_copy(update={"agent": "tests.worker.agent_probe:broken"})
    )
    client = allowing.store.client
    outcomes = []
    for attempt in (1, 2, 3):
        report = execute_run(allowing, run_id, owner=f"w-{attempt}")  # never raises
        outcomes.append(report.outcome)
        snap = allowing.store.read_run(run_id)
        assert not snap.lease_live  # the lease was given up at once
        errors = [i for i in allowing.store.records.incidents(run_id) if i["kind"] == "job_error"]
        assert errors[0]["attempt"] == attempt and errors[0]["error"] == "TypeError"
        assert "agent_probe.py" in str(errors[0]["where"])
        score = client.zscore(EXPIRY_INDEX, run_id)
        if attempt < 3:  # back on the reaper's index, due after the (doubling) backoff
            assert score is not None
            assert score >= allowing.store.server_time_ms() + 1000 * 2 ** (attempt - 1) - 500
    assert outcomes == ["job_error", "job_error", "poisoned"]
    assert client.zscore(EXPIRY_INDEX, run_id) is None  # frozen: nothing retries it
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        assert adapter.effects == 0
