"""The tools demo end to end: a tool-calling agent driven by a stub chat model fixes the
example repository and files a ticket through a real MCP server, on a fleet of three real
worker processes with one SIGKILLed while it holds a lease mid-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.demo.tools import TICKET_TOOL, run_tools_demo, scripted_turn


def test_three_workers_one_killed_complete_every_run_with_one_ticket_each(
    tmp_path: Path,
) -> None:
    os.environ.setdefault("RATCHET_LOG_LEVEL", "WARNING")
    report = run_tools_demo(runs=2, workers=3, state_dir=tmp_path, deadline_s=200)
    assert report.workers_killed == 1, report.as_dict()
    assert report.takeovers >= 1
    assert report.completed == 2
    assert report.tickets_created == 2  # exactly one per run, counted by the MCP server
    assert report.duplicate_effects == 0
    assert report.greeting_fixed == 2
    assert report.ok


def test_the_stub_model_answers_from_the_conversation_alone() -> None:
    """A worker that takes a run over shows the model the same conversation and gets the
    same next step: the answer depends on the tool results so far, nothing else."""
    first = scripted_turn({"messages": [{"role": "user", "content": "go"}]})
    assert first["tool_calls"][0]["name"] == "read_file"
    two_done = {"messages": [{"role": "tool"}, {"role": "tool"}]}
    assert scripted_turn(two_done) == scripted_turn(two_done)
    assert scripted_turn(two_done)["tool_calls"][0]["name"] == TICKET_TOOL
    assert "content" in scripted_turn({"messages": [{"role": "tool"}] * 4})


def test_the_cli_runs_the_tools_demo_and_prints_its_report() -> None:
    result = CliRunner().invoke(app, ["demo", "--tools", "--runs", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["tickets_created"] == 1
