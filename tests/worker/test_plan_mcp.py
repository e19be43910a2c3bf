"""The plan file docs/task-file.md shows ("A plan that calls an MCP tool"), with its task
file, as a user runs them: through the task-file parser ``ratchet submit`` uses, on a
worker, against the project's tickets MCP server over streamable HTTP. Only the server's
URL (a free port here) differs from the page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.demo.examples import RIGHT_GREETING, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run, submit
from ratchet.ops.taskfile import load_task_file
from ratchet.runtime.canonical import strict_yaml_loads
from ratchet.worker.job import execute_run
from tests.docs_blocks import ROOT, named
from tests.tools.conftest import Tickets

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "task-file.md"


def test_the_documented_plan_files_one_ticket_through_an_mcp_server_and_completes(
    fleet: Fleet, tmp_path: Path
) -> None:
    tickets = Tickets(tmp_path / "tickets")
    try:
        url = tickets.serve_http()
        task = strict_yaml_loads(named(PAGE, "mcp-task").text)
        task["environment"]["mcp"]["tickets"]["url"] = url
        folder = tmp_path / "submit"
        root = make_greeting_workspace(folder / "ws")
        (folder / "task.json").write_text(json.dumps(task), encoding="utf-8")
        plan = folder / "plan.yaml"
        plan.write_text(named(PAGE, "mcp-plan").text, encoding="utf-8")
        document = load_task_file(folder / "task.json", str(plan))
        assert document.agent == "scripted"

        run_id = submit(fleet, document, run_id="r-plan-mcp")
        report = execute_run(fleet, run_id, owner="w-1")

        assert report.phase == "completed", report
        assert (root / "app.py").read_text() == RIGHT_GREETING
        assert tickets.stats().effects == 1
        state = inspect_run(fleet, run_id).state
        writes = [json.dumps(w.receipt.model_dump(mode="json")) for w in state.executed]
        assert len(writes) == 2  # the fix, then the ticket: one receipt each
        assert "tickets_create_ticket" in writes[1]
    finally:
        tickets.close()
