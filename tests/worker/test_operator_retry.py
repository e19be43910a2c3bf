"""Retry after the cause is fixed: a run frozen by an outside cause (an agent this worker
could not load, a poisoned job) is handed back by an operator, attributed, and restored by
the worker with every check, as any job is."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.errors import ContractError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.ops import retry, submit
from ratchet.redis_server import RedisServer
from ratchet.worker.job import execute_run
from tests.worker.conftest import CHECKPOINT_KEY_HEX

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def test_a_run_refused_for_an_agent_the_worker_could_not_load_completes_after_a_retry(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    allowing = Fleet.connect(fleet.settings.model_copy(update={"agents": ("tests.worker",)}))
    root, document = workspace(runner="python")
    run_id = submit(
        allowing, document.model_copy(update={"agent": "tests.worker.agent_probe:make"})
    )
    assert execute_run(fleet, run_id, owner="w-old").outcome == "restore_refused"
    # The operator fixed the workers' allow-list, then hands the run back.
    retry(allowing, run_id, reason="agents allow-list fixed", operator="olga")
    incidents = allowing.store.records.incidents(run_id)
    assert incidents[0]["kind"] == "operator_retry" and incidents[0]["operator"] == "olga"
    assert execute_run(allowing, run_id, owner="w-new").phase == "completed"
    assert effects(root) == 1


def test_a_retry_starts_the_job_error_budget_again(fleet: Fleet, workspace: MakeWorkspace) -> None:
    allowing = Fleet.connect(
        fleet.settings.model_copy(update={"agents": ("tests.worker",), "max_job_errors": 2})
    )
    _root, document = workspace()
    run_id = submit(
        allowing, document.model_copy(update={"agent": "tests.worker.agent_probe:broken"})
    )
    outcomes = [execute_run(allowing, run_id, owner="w").outcome for _ in range(2)]
    assert outcomes == ["job_error", "poisoned"]
    retry(allowing, run_id, reason="redeployed the agent", operator="olga")
    assert execute_run(allowing, run_id, owner="w").outcome == "job_error"  # attempt 1


def test_a_terminal_or_held_run_is_not_retried(fleet: Fleet, workspace: MakeWorkspace) -> None:
    _root, document = workspace(runner="python")
    done = submit(fleet, document)
    assert execute_run(fleet, done, owner="w").phase == "completed"
    with pytest.raises(ContractError, match="completed"):
        retry(fleet, done, reason="why not", operator="olga")
    _root2, other = workspace(runner="python")
    held = submit(fleet, other)
    assert fleet.store.acquire(held, owner="w-live", ttl_ms=60_000) is not None
    with pytest.raises(ContractError, match="holds the run"):
        retry(fleet, held, reason="why not", operator="olga")
    with pytest.raises(ContractError, match="say why"):
        retry(fleet, held, reason=" ", operator="olga")


def test_the_retry_command_answers_in_one_line(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    _root, document = workspace(runner="python")
    run_id = submit(fleet, document)
    assert execute_run(fleet, run_id, owner="w").phase == "completed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(RATCHET_REDIS_URL=redis_server.url, RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX)
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli.entry", "retry", run_id, "--reason", "test"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and done.stderr.startswith("ratchet: error:")
    assert len(done.stderr.strip().splitlines()) == 1
