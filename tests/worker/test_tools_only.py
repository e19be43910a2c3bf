"""A run of declared tools only (``environment.kind: tools``): no folder and no verifier
command; its completion evidence is a read tool's output (``environment.checks``). Any
host continues it (its ledger is in the store), a cut-off call is recovered by the tool's
own recovery, and the effect happens once."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.chaos.failpoints import FailpointFired
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, RunDocument, ToolCheckSpec
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Scenario
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow

PLUGIN = '''
import json
from pathlib import Path

import ratchet

BOOK = []  # the refunds book's path, set by the test


def _load():
    path = Path(BOOK[0])
    return json.loads(path.read_text()) if path.exists() else {"refunds": {}, "calls": 0}


@ratchet.tool(risk="reversible_write", idempotent=True)
def issue_refund(order_id: str, amount_cents: int) -> dict:
    """Refund an order (the book dedupes by order)."""
    book = _load()
    book["calls"] += 1
    book["refunds"].setdefault(order_id, amount_cents)
    Path(BOOK[0]).write_text(json.dumps(book))
    return {"order_id": order_id, "refunded": book["refunds"][order_id]}


@ratchet.tool(risk="read_only")
def refund_status(order_id: str) -> dict:
    """What the book says of an order."""
    refunded = _load()["refunds"].get(order_id)
    return {"order_id": order_id, "status": "refunded" if refunded else "open"}
'''


@pytest.fixture
def refunds(tmp_path: Path) -> Iterator[Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "refund_book.py").write_text(PLUGIN)
    info = site / "refund_book-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: refund-book\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[ratchet.tools]\nissue_refund = refund_book:issue_refund\n"
        "refund_status = refund_book:refund_status\n"
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    book = tmp_path / "book.json"
    importlib.import_module("refund_book").BOOK[:] = [str(book)]
    try:
        yield book
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("refund_book", None)
        importlib.invalidate_caches()


def refund_document() -> RunDocument:
    scenario = Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "refund-o1",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": ["issue_refund", "refund_status", "run_verifier", "finish"],
            "allowed_paths": [],
            "allowed_verifier_targets": ["refunded"],
            "approval_required": [],
            "budgets": {"proposals": 10, "steps": 10, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {},
            "verifier": {"target": "refunded"},
        }
    )
    steps = [
        {"kind": "issue_refund", "args": {"order_id": "o-1", "amount_cents": 1250}},
        {"kind": "run_verifier", "args": {"target": "refunded"}},
        {"kind": "finish", "args": {"summary": "refunded o-1"}},
    ]
    check = ToolCheckSpec(
        tool="refund_status", arguments={"order_id": "o-1"}, expect={"status": "refunded"}
    )
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": steps},
        environment=EnvironmentSpec(kind="tools", checks={"refunded": check}),
    )


def book(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_a_tools_only_run_completes_with_no_folder_its_evidence_a_read_tool(
    fleet: Fleet, refunds: Path
) -> None:
    run_id = submit(fleet, refund_document(), run_id="r-tools")
    view = inspect_run(fleet, run_id)
    assert view.document.environment.root is None and view.document.environment.host is None
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.phase == "completed", report
    assert book(refunds) == {"refunds": {"o-1": 1250}, "calls": 1}
    verified = [e for e in inspect_run(fleet, run_id).state.trace if e.outcome.value == "verified"]
    assert verified and verified[-1].verifier is not None and verified[-1].verifier.passed


class DieAfterTheCall(WorkerHooks):
    def write_stage(self, stage: str) -> None:
        if stage == "after_call":
            raise FailpointFired("after_call")


def test_a_call_cut_off_is_recovered_on_another_host_and_happens_once(
    fleet: Fleet, settings: Settings, refunds: Path, tmp_path: Path
) -> None:
    run_id = submit(fleet, refund_document(), run_id="r-tools-cut")
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-a", hooks=DieAfterTheCall())
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    elsewhere = Fleet.connect(
        settings.model_copy(update={"host": "far", "state_dir": tmp_path / "far"})
    )
    report = execute_run(elsewhere, run_id, owner="w-far")
    assert report.phase == "completed", report
    seen = book(refunds)
    assert seen["refunds"] == {"o-1": 1250} and seen["calls"] == 2  # replayed by key, once


def test_a_check_that_does_not_hold_does_not_complete_the_run(fleet: Fleet, refunds: Path) -> None:
    document = refund_document()
    env = document.environment
    wrong = ToolCheckSpec(
        tool="refund_status", arguments={"order_id": "o-2"}, expect={"status": "refunded"}
    )
    document = document.model_copy(
        update={"environment": env.model_copy(update={"checks": {"refunded": wrong}})}
    )
    run_id = submit(fleet, document, run_id="r-tools-unverified")
    execute_run(fleet, run_id, owner="w-1")
    state = inspect_run(fleet, run_id).state
    assert state.phase.value != "completed"
    outcomes = [e.outcome.value for e in state.trace]
    assert "rejected_unverified" in outcomes or "verification_failed" in outcomes, outcomes


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {
                "permissions": [
                    "issue_refund",
                    "refund_status",
                    "read_file",
                    "run_verifier",
                    "finish",
                ]
            },
            "no folder",
        ),
        ({"allowed_verifier_targets": ["refunded", "other"]}, "no command or check"),
    ],
)
def test_a_tools_environment_refuses_what_needs_a_folder_or_an_unchecked_target(
    fleet: Fleet, refunds: Path, change: dict[str, Any], message: str
) -> None:
    document = refund_document()
    data = document.scenario.model_dump(mode="json")
    if "read_file" in change.get("permissions", []):
        data["allowed_paths"] = ["notes.txt"]
    scenario = Scenario.model_validate({**data, **change})
    with pytest.raises(ConfigurationError, match=message):
        submit(fleet, document.model_copy(update={"scenario": scenario}), run_id="r-bad")
