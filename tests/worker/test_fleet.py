"""The fleet end to end: real worker processes, a real Redis, real workspaces.

Killed, paused and stopped workers; every run completes and every intent's write happens
exactly once, counted by the workspace adapter's own journal.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import run_keys
from ratchet.ops import approve, inspect_run, submit
from tests.worker.fleet_harness import (
    holder_pid,
    job_outcomes,
    phase,
    poll,
    process_state,
    submit_greetings,
    workers,
)

pytestmark = pytest.mark.slow


def journal(root: Path) -> tuple[int, int]:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects, adapter.refused_stale


def owners(fleet: Fleet, run_id: str) -> list[str]:
    raw = fleet.store.client.lrange(run_keys(run_id).history, 0, -1)
    return [entry.decode().split("|")[3] for entry in raw]


def test_twenty_runs_on_three_workers_survive_a_sigkill_with_one_write_each(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    runs = submit_greetings(fleet, tmp_path, 20, think_ms=60)
    with workers(settings) as pool:
        procs = pool.start(3)
        pids = {p.pid for p in procs}
        victim: list[int] = []

        def someone_mid_run() -> bool:
            for run_id in runs:
                pid = holder_pid(fleet, run_id)
                if pid in pids and fleet.store.read_run(run_id).generation >= 3:
                    os.kill(pid, signal.SIGKILL)
                    victim.append(pid)
                    return True
            return False

        poll(someone_mid_run, deadline_s=60, what="a worker holding a lease mid-run")
        poll(
            lambda: all(phase(fleet, r) == "completed" for r in runs),
            deadline_s=120,
            what="every run completed",
        )
    for run_id, root in runs.items():
        effects, _ = journal(root)
        assert effects == 1, run_id
        assert (root / "app.py").read_text() == RIGHT_GREETING
    killed_owner_runs = [
        r for r in runs if any(o.endswith(f"-{victim[0]}") for o in owners(fleet, r))
    ]
    assert killed_owner_runs, "the killed worker had committed for at least one run"


def test_a_worker_paused_past_its_lease_gets_no_commit_and_no_write_accepted(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    ((run_id, root),) = submit_greetings(fleet, tmp_path, 1, think_ms=0).items()
    with workers(settings) as pool:
        (zombie,) = pool.start(1, env={"RATCHET_FAILPOINTS": "after_pending_before_adapter=pause"})
        assert zombie.pid is not None
        poll(
            lambda: process_state(zombie.pid or 0) == "T",
            deadline_s=60,
            what="the first worker stopped right after its pending commit",
        )
        generation_at_pause = fleet.store.read_run(run_id).generation
        pool.start(1)  # its reaper sees the expired lease and takes the run over
        poll(
            lambda: phase(fleet, run_id) == "completed",
            deadline_s=60,
            what="the run completed by the second worker",
        )
        final = fleet.store.read_run(run_id).generation
        os.kill(zombie.pid, signal.SIGCONT)  # the zombie wakes up and tries to go on
        # Its job ends, reporting that it found its lease lost, before any effect.
        poll(
            lambda: "lease_lost" in job_outcomes(fleet, run_id),
            deadline_s=30,
            what="the zombie's job giving up on its lost lease",
        )
    assert fleet.store.read_run(run_id).generation == final
    effects, _ = journal(root)
    assert effects == 1
    zombie_owner = f"-{zombie.pid}"
    late = [
        o for o in owners(fleet, run_id)[: final - generation_at_pause] if o.endswith(zombie_owner)
    ]
    assert late == [], "no commit from the paused worker after the takeover"


def test_sigterm_finishes_the_step_releases_the_lease_and_exits(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    ((run_id, root),) = submit_greetings(fleet, tmp_path, 1, think_ms=400).items()
    with workers(settings) as pool:
        (first,) = pool.start(1)
        poll(
            lambda: holder_pid(fleet, run_id) == first.pid,
            deadline_s=60,
            what="the worker holding the run",
        )
        assert first.pid is not None
        os.kill(first.pid, signal.SIGTERM)
        first.join(timeout=30)
        assert first.exitcode == 0
        snap = fleet.store.read_run(run_id)
        assert not snap.lease_live  # released, not left to expire
        assert phase(fleet, run_id) != "completed"
        pool.start(1)
        poll(
            lambda: phase(fleet, run_id) == "completed",
            deadline_s=60,
            what="another worker finished the run",
        )
    assert journal(root)[0] == 1


def test_a_run_waiting_for_approval_completes_after_it_is_approved(
    redis_server: object,
    settings: Settings,
    tmp_path: Path,
    workspace: Callable[..., tuple[Path, object]],
) -> None:
    key = Ed25519PrivateKey.generate()
    trust = tmp_path / "approvers.json"
    trust.write_text(
        json.dumps({"alice": key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()})
    )
    settings = settings.model_copy(update={"approvers_file": trust})
    fleet = Fleet.connect(settings)
    root = make_greeting_workspace(tmp_path / "approve-ws")
    run_id = submit(
        fleet, greeting_document(root, approval_required=("write_file",), runner="python")
    )
    with workers(settings) as pool:
        pool.start(1)
        poll(
            lambda: (
                phase(fleet, run_id) == "awaiting_approval"
                and not fleet.store.read_run(run_id).lease_live
            ),
            deadline_s=60,
            what="the run waiting for approval with its lease released",
        )
        assert journal(root)[0] == 0
        pending = inspect_run(fleet, run_id).state.pending
        assert pending is not None
        approve(fleet, run_id, pending.action.action_id, key=key, approver_id="alice")
        poll(
            lambda: phase(fleet, run_id) == "completed",
            deadline_s=60,
            what="the approved run completed",
        )
    assert journal(root)[0] == 1
    receipt = inspect_run(fleet, run_id).state.executed[-1].receipt
    assert receipt.approval_digest is not None


def test_a_worker_killed_while_holding_a_coalesced_receipt_commit_loses_no_write(
    fleet: Fleet, settings: Settings, tmp_path: Path
) -> None:
    # The example agent without a think delay plans ahead, so the write's receipt commit
    # is held to travel with the verification's commit. The first worker dies right before
    # that proposal (its third: read, write, verify): the receipt never left the process.
    ((run_id, root),) = submit_greetings(fleet, tmp_path, 1, think_ms=0).items()
    with workers(settings) as pool:
        (doomed,) = pool.start(1, env={"RATCHET_FAILPOINTS": "before_proposal=kill@3"})
        poll(lambda: not doomed.is_alive(), deadline_s=60, what="the doomed worker died")
        assert doomed.exitcode == -signal.SIGKILL
        stored = inspect_run(fleet, run_id).state
        assert stored.pending is not None and stored.pending.receipt is None  # intent only
        assert journal(root)[0] == 1  # ... and the write happened
        pool.start(1)
        poll(
            lambda: phase(fleet, run_id) == "completed",
            deadline_s=60,
            what="the run completed on the second worker",
        )
    state = inspect_run(fleet, run_id).state
    assert [e.outcome.value for e in state.trace].count("reconciled") == 1
    assert journal(root)[0] == 1
    assert (root / "app.py").read_text() == RIGHT_GREETING
