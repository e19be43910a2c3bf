"""A worker on a primary with a replica and Sentinel, with the acknowledgement rule on: a
commit no replica confirmed is never acted on."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.chaos.hooks import DrillHooks
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.ops import inspect_run, submit
from ratchet.runtime import CrashWindow
from ratchet.testing.sentinel import LocalReplicated
from ratchet.worker.job import execute_run
from tests.conftest import test_sandbox_mode
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import poll


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[LocalReplicated]:
    with LocalReplicated(tmp_path / "replicated") as topo:
        RedisStore(topo.primary.client()).identity.init_epoch()
        topo.wait_in_sync()
        yield topo


def _fleet(topo: LocalReplicated, tmp_path: Path) -> Fleet:
    return Fleet.connect(
        Settings(
            redis_url=SecretStr(topo.url),
            state_dir=tmp_path / "state",
            queue=f"q-{secrets.token_hex(4)}",
            lease_ttl_ms=1500,
            renew_interval_ms=300,
            job_timeout_s=600,
            min_replicas_ack=1,
            replicas_ack_timeout_ms=300,
            checkpoint_key=SecretStr(CHECKPOINT_KEY_HEX),
            verifier_sandbox=test_sandbox_mode(),
        )
    )


def _effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def test_a_job_whose_commit_no_replica_confirmed_stops_before_any_effect(
    topology: LocalReplicated, tmp_path: Path
) -> None:
    fleet = _fleet(topology, tmp_path)
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(fleet, greeting_document(root))
    (replica,) = topology.replicas
    paused: list[CrashWindow] = []

    def pause_once(window: CrashWindow) -> None:
        # After the acquire and the restore (both confirmed), before the first proposal.
        if window is CrashWindow.BEFORE_PROPOSAL and not paused:
            replica.pause()  # connected, confirming nothing
            paused.append(window)

    try:
        report = execute_run(fleet, run_id, owner="w-1", hooks=DrillHooks(probe=pause_once))
    finally:
        replica.resume()
    assert paused
    # The engine did not read the commit back from the primary and adopt it: the job
    # ended at the first unconfirmed commit, before its write reached the workspace.
    assert report.outcome == "lease_lost"
    assert report.detail == "store: ReplicationUnconfirmedError"
    assert _effects(root) == 0
    # Once the replica confirms again, the next owner finishes the run with one write.
    poll(
        lambda: not fleet.store.read_run(run_id).lease_live,
        deadline_s=10,
        what="the unused lease expired",
    )
    done = execute_run(fleet, run_id, owner="w-2")
    assert (done.outcome, done.phase) == ("finished", "completed")
    assert _effects(root) == 1
    assert (root / "app.py").read_text() == RIGHT_GREETING
    assert inspect_run(fleet, run_id).state.phase.value == "completed"


def test_a_lease_no_replica_confirmed_is_not_used_to_restore_or_write(
    topology: LocalReplicated, tmp_path: Path
) -> None:
    fleet = _fleet(topology, tmp_path)
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(fleet, greeting_document(root))
    generation = fleet.store.read_run(run_id).generation
    (replica,) = topology.replicas
    replica.pause()
    try:
        report = execute_run(fleet, run_id, owner="w-1")
    finally:
        replica.resume()
    assert (report.outcome, report.detail) == ("lease_lost", "store: ReplicationUnconfirmedError")
    assert fleet.store.read_run(run_id).generation == generation  # nothing committed
    assert _effects(root) == 0
