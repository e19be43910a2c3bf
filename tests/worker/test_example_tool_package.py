"""The example tool package (``examples/tool-package/``), installed the way pip leaves a
package (its module folder and a dist-info with the entry points its ``pyproject.toml``
declares, on ``sys.path``): the task file and plan its README shows run on a worker, each
tool has the recovery the README says, and a crash right after either write's call is
settled by the next worker (on another host, the MCP server started anew) with the
effect once."""

from __future__ import annotations

import importlib
import json
import sqlite3
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.chaos.failpoints import FailpointFired
from ratchet.errors import AdapterError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.ops.taskfile import load_task_file
from ratchet.tools import ToolCall, load_entry_point_tool
from ratchet.tools.mcp import close_shared
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run
from tests.docs_blocks import ROOT, named
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow

PACKAGE = ROOT / "examples" / "tool-package"
README = PACKAGE / "README.md"


@pytest.fixture
def example_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The package installed, its state folder (the worker's ``EXAMPLE_TOOLS_DIR``)."""
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    site = tmp_path / "site"
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    points = project["entry-points"]["ratchet.tools"]
    (info / "entry_points.txt").write_text(
        "[ratchet.tools]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
    )
    state = tmp_path / "example-state"
    monkeypatch.setenv("EXAMPLE_TOOLS_DIR", str(state))
    sys.path[:0] = [str(site), str(PACKAGE)]
    importlib.invalidate_caches()
    close_shared()
    try:
        yield state
    finally:
        close_shared()  # the notes server goes with the test
        for entry in (str(site), str(PACKAGE)):
            sys.path.remove(entry)
        for module in [m for m in sys.modules if m.split(".")[0] == "ratchet_example_tools"]:
            del sys.modules[module]
        importlib.invalidate_caches()


def submitted(fleet: Fleet, folder: Path, run_id: str) -> str:
    """The README's task file and plan, through the parser ``ratchet submit`` uses."""
    folder.mkdir()
    task = folder / "task.yaml"
    task.write_text(named(README, "task").text, encoding="utf-8")
    plan = folder / "plan.yaml"
    plan.write_text(named(README, "plan").text, encoding="utf-8")
    return submit(fleet, load_task_file(task, str(plan)), run_id=run_id)


def invoices(state: Path) -> list[dict[str, Any]]:
    lines = (state / "outbox.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def notes(state: Path) -> list[str]:
    """The notes the server keeps (none before its first note: no table yet)."""
    with sqlite3.connect(state / "notes.sqlite3") as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
        if "notes" not in tables:
            return []
        return [text for (text,) in conn.execute("SELECT text FROM notes ORDER BY id")]


def test_each_tool_has_the_risk_and_recovery_the_readme_gives_it(example_tools: Path) -> None:
    specs = {
        name: load_entry_point_tool(name).spec
        for name in ("send_invoice", "invoice_status", "notes_add_note", "notes_list_notes")
    }
    shown = {
        name: (s.risk.value, s.recovery.value if s.is_write else None) for name, s in specs.items()
    }
    assert shown == {
        "send_invoice": ("irreversible_external_write", "lookup"),
        "invoice_status": ("read_only", None),
        "notes_add_note": ("irreversible_external_write", "lookup"),
        "notes_list_notes": ("read_only", None),
    }
    text = README.read_text(encoding="utf-8")
    for name, (risk, recovery) in shown.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}`"))
        assert f"`{risk}`" in row and (recovery is None or f"`{recovery}`" in row), row


def test_a_note_the_server_refuses_in_plain_text_is_a_refusal_with_no_effect(
    example_tools: Path,
) -> None:
    tool = load_entry_point_tool("notes_add_note")
    call = ToolCall(run_id="r-1", tool="notes_add_note", idempotency_key="k-1", fence=None)
    with pytest.raises(AdapterError) as refused:
        tool.run({"text": "x" * 5000}, call)
    assert refused.value.retryable is False
    assert notes(example_tools) == []


def test_the_readme_task_and_plan_complete_on_a_worker_with_one_effect_each(
    fleet: Fleet, example_tools: Path, tmp_path: Path
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", "r-example")
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.phase == "completed", report
    assert [(i["customer"], i["amount_cents"]) for i in invoices(example_tools)] == [("acme", 1250)]
    (note,) = notes(example_tools)
    assert note.startswith("Invoiced acme") and "\n\nRatchet-Key: " in note


class DieAfterCall(WorkerHooks):
    """The worker dies right after the n-th write's call returned (nothing recorded it)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def write_stage(self, stage: str) -> None:
        if stage == "after_call":
            self.left -= 1
            if self.left == 0:
                raise FailpointFired("after_call")


@pytest.mark.parametrize(("n", "tool"), [(1, "send_invoice"), (2, "notes_add_note")])
def test_a_call_cut_off_after_it_returned_is_found_by_its_key_and_happens_once(
    fleet: Fleet,
    settings: Settings,
    example_tools: Path,
    tmp_path: Path,
    n: int,
    tool: str,
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", f"r-example-cut-{n}")
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-a", hooks=DieAfterCall(n))
    close_shared()  # the worker's process is gone, and its notes server with it
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    elsewhere = Fleet.connect(
        settings.model_copy(update={"host": "far", "state_dir": tmp_path / "far"})
    )
    report = execute_run(elsewhere, run_id, owner="w-far")
    assert report.phase == "completed", report
    assert len(invoices(example_tools)) == 1
    assert len(notes(example_tools)) == 1
    outcomes = [e.outcome.value for e in inspect_run(fleet, run_id).state.trace]
    assert "reconciled" in outcomes, (tool, outcomes)
