"""The declared tools' ledger lives in the store: recovery paths that repeated an effect.

A real redis-server, a real MCP server (the tickets service over streamable HTTP: its
``create_ticket`` has neither a lookup nor idempotency, so its recovery is ``review``:
the ledger's ``started`` row is the one proof of whether a call was sent), and the
worker's own job code, ended exactly where a worker would die after the tool returned
and before anything recorded it (``after_call``).

Before, the ledger was a file in the workspace folder:

* (b) the workspace's disk restored from a backup taken before the call: the ledger said
  "no row, so never sent", the next job sent the call again: two tickets for one key;
* (a) a cancel looked the key up in a ledger that could not see the call (an empty one
  on another host) and dropped it as absent; the same task submitted again wrote a
  second ticket.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ratchet.chaos.failpoints import FailpointFired
from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.demo.tools import TICKET_TOOL
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument
from ratchet.fleet.settings import Settings
from ratchet.ops import cancel, inspect_run, submit
from ratchet.runtime import Phase, ReviewReason, Scenario
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run
from tests.tools.conftest import Tickets
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow


def lease_expired(fleet: Fleet, run_id: str) -> None:
    """Poll the store (its clock) until the dead worker's lease has expired."""
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expired")


class DieAfterTheCall(WorkerHooks):
    """The worker dies right after the tool returned, before anything recorded it."""

    def write_stage(self, stage: str) -> None:
        if stage == "after_call":
            raise FailpointFired("after_call")


def ticket_document(root: Path, mcp_url: str) -> RunDocument:
    """A run whose agent (a tool-calling agent playing a script) files one ticket."""
    plain = greeting_document(root, runner="python")
    data = plain.scenario.model_dump(mode="json")
    scenario = Scenario.model_validate({**data, "permissions": [*data["permissions"], TICKET_TOOL]})
    call = {"id": "c1", "name": TICKET_TOOL, "arguments": '{"title": "t", "body": "b"}'}
    return RunDocument(
        scenario=scenario,
        agent="tool_calling",
        agent_config={
            "model": {"kind": "scripted", "replies": [{"tool_calls": [call]}]},
            "system_prompt": "File the ticket.",
        },
        environment=EnvironmentSpec(
            root=plain.environment.root,
            verifiers=plain.environment.verifiers,
            mcp={"tickets": McpServerSpec(url=mcp_url, prefix="tickets_")},
        ),
    )


@pytest.fixture
def tickets(tmp_path: Path) -> Tickets:
    service = Tickets(tmp_path / "tickets")
    yield service  # type: ignore[misc]
    service.close()


def cut_off_call(fleet: Fleet, root: Path, url: str, run_id: str) -> None:
    """Submit the run and end its first job right after the ticket was created."""
    submit(fleet, ticket_document(root, url), run_id=run_id)
    document = inspect_run(fleet, run_id).document
    assert document.environment.tools_ledger == "store"  # signed at submit
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-dies", hooks=DieAfterTheCall())


def test_a_disk_restored_from_a_backup_taken_before_the_call_never_repeats_it(
    settings: Settings, tmp_path: Path, tickets: Tickets
) -> None:
    fleet = Fleet.connect(settings.model_copy(update={"lease_ttl_ms": 1000}))
    url = tickets.serve_http()
    root = make_greeting_workspace(tmp_path / "ws")
    backup = tmp_path / "backup"
    submit_and_backup = "r-backup"
    # The backup is taken after submit, before any job ran (before the call).
    submit(fleet, ticket_document(root, url), run_id=submit_and_backup)
    shutil.copytree(root, backup, symlinks=True)
    with pytest.raises(FailpointFired):
        execute_run(fleet, submit_and_backup, owner="w-dies", hooks=DieAfterTheCall())
    assert tickets.stats().effects == 1
    # The host's disk comes back from the backup: the workspace as it was before the call.
    shutil.rmtree(root)
    shutil.copytree(backup, root, symlinks=True)
    lease_expired(fleet, submit_and_backup)
    # Whoever takes the run next finds the call's started row in the store: its outcome is
    # unknown (the tool can neither look it up nor be called again), so a reviewer decides.
    report = execute_run(fleet, submit_and_backup, owner="w-next")
    view = inspect_run(fleet, submit_and_backup)
    assert view.state.phase is Phase.NEEDS_REVIEW, report
    case = view.state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    assert tickets.stats().effects == 1 and tickets.stats().calls == 1


def test_a_cancel_never_drops_a_key_whose_call_it_cannot_see_the_run_waits_for_a_reviewer(
    settings: Settings, tmp_path: Path, tickets: Tickets
) -> None:
    fleet = Fleet.connect(settings.model_copy(update={"lease_ttl_ms": 1000}))
    url = tickets.serve_http()
    root = make_greeting_workspace(tmp_path / "ws")
    cut_off_call(fleet, root, url, "r-cancelled")
    assert tickets.stats().effects == 1
    # The host's disk is lost: the workspace (and anything kept in it) is gone, and a new
    # one takes its place at the same path.
    shutil.rmtree(root)
    make_greeting_workspace(root)
    lease_expired(fleet, "r-cancelled")
    cancel(fleet, "r-cancelled", reason="the host was lost", operator="alice")
    execute_run(fleet, "r-cancelled", owner="w-other")
    view = inspect_run(fleet, "r-cancelled")
    # The ledger in the store still has the call's started row: the cancel cannot settle
    # it as absent, so the run is not ended with the key dropped.
    pending = view.state.pending
    dropped = [
        e
        for e in view.state.trace
        if e.detail.get("looked_up") == "absent" and e.idempotency_key is not None
    ]
    assert dropped == [], dropped
    assert view.state.phase is Phase.NEEDS_REVIEW, view.state.phase
    case = view.state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    assert (
        pending is not None
        and pending.action.idempotency_key == case.pending.action.idempotency_key
    )
    assert tickets.stats().effects == 1 and tickets.stats().calls == 1
