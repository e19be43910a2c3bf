"""Runs of the shops' agents on a fleet: their run document, and jobs in the test's own
process until a run comes to rest."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
from ratchet.ops import inspect_run
from ratchet.runtime import Scenario, TraceOutcome
from ratchet.worker.job import execute_run
from tests.worker.fleet_harness import phase

BUDGETS = {"proposals": 20, "steps": 20, "wall_clock_seconds": 3600, "cost_units": 0}


def shop_document(
    root: Path,
    agent: str,
    *,
    tools: list[str],
    approval_required: tuple[str, ...] = (),
    budgets: dict[str, int] | None = None,
    agent_config: dict[str, Any] | None = None,
) -> RunDocument:
    """A run of a shop agent (``agent``: ``module:factory`` in this package): its tools,
    a verifier that passes, and ``finish``."""
    scenario = Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "shop",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": ["run_verifier", "finish", *tools],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": list(approval_required),
            "budgets": budgets or BUDGETS,
            "initial_files": {},
            "verifier": {"target": "unit", "expected_files": {}},
        }
    )
    verifier = VerifierSpec(argv=(sys.executable, "-c", "pass"), timeout_seconds=60)
    return RunDocument(
        scenario=scenario,
        agent=f"tests.integrations.{agent}",
        agent_config={"verify_target": "unit", **(agent_config or {})},
        environment=EnvironmentSpec(root=str(root.resolve()), verifiers={"unit": verifier}),
    )


def outcomes(fleet: Fleet, run_id: str) -> list[TraceOutcome]:
    return [e.outcome for e in inspect_run(fleet, run_id).state.trace]


def run_to_rest(fleet: Fleet, run_id: str, owner: str, *, jobs: int = 10) -> str:
    """Jobs in this process until the run completes, fails or waits for a person."""
    for n in range(jobs):
        execute_run(fleet, run_id, owner=f"{owner}-{n}")
        now = phase(fleet, run_id)
        if now != "running":
            return now
    return phase(fleet, run_id)
