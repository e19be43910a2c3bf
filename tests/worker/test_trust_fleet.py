"""The trust boundary under real worker processes: a rewritten run document, an agent
outside the worker's allow-list, a worker clock two hours behind, and a wiped store, each
met by a spawned worker (its own interpreter, settings and environment) that refuses and
does nothing outside the signed state."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument, VerifierSpec
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore, run_keys
from ratchet.ops import approve, inspect_run, submit
from ratchet.redis_server import RedisServer
from tests.ops.helpers import run_awaiting_approval, trust_file, with_trust
from tests.worker.fleet_harness import job_outcomes, poll, workers

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]
ALICE = Ed25519PrivateKey.generate()


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def incident(fleet: Fleet, run_id: str, kind: str) -> dict[str, object] | None:
    return next((i for i in fleet.store.records.incidents(run_id) if i.get("kind") == kind), None)


def test_a_worker_process_runs_nothing_from_a_document_rewritten_in_redis(
    fleet: Fleet, settings: Settings, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    root, document = workspace()
    run_id = submit(fleet, document)
    marker = tmp_path / "verifier-ran"
    shell = VerifierSpec(argv=("/bin/sh", "-c", f"touch {marker}; exit 0"))
    hostile = document.model_copy(
        update={
            "environment": document.environment.model_copy(update={"verifiers": {"unit": shell}})
        }
    )
    fleet.store.client.set(run_keys(run_id).scenario, hostile.model_dump_json().encode())
    with workers(settings) as pool:
        pool.start(1)
        poll(
            lambda: incident(fleet, run_id, "restore_refused") is not None,
            deadline_s=60,
            what="the worker refused the run",
        )
    found = incident(fleet, run_id, "restore_refused")
    assert found is not None and found["reason"] == "document"
    assert not marker.exists() and effects(root) == 0


def test_a_worker_process_loads_no_agent_outside_its_allow_list(
    fleet: Fleet, settings: Settings, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    marker = tmp_path / "agent-imported"
    root, document = workspace()
    submitter = Fleet.connect(settings.model_copy(update={"agents": ("tests.worker",)}))
    run_id = submit(
        submitter, document.model_copy(update={"agent": "tests.worker.agent_probe:make"})
    )
    with workers(settings) as pool:  # the workers' own settings allow no such prefix
        pool.start(1, env={"RATCHET_PROBE_AGENT_MARKER": str(marker)})
        poll(
            lambda: incident(fleet, run_id, "restore_refused") is not None,
            deadline_s=60,
            what="the worker refused the agent",
        )
    found = incident(fleet, run_id, "restore_refused")
    assert found is not None and "not allowed on this worker" in str(found["message"])
    assert not marker.exists() and effects(root) == 0


def skewed_python(tmp_path: Path, seconds: int) -> dict[str, str]:
    """The environment of a worker whose wall clock is ``seconds`` off: a sitecustomize
    that shifts ``time.time`` in every interpreter it starts."""
    site = tmp_path / f"skew{seconds}"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import time
        _real = time.time
        time.time = lambda: _real() + ({seconds})
    """)
    )
    return {"PYTHONPATH": f"{site}:{':'.join(p for p in sys.path if p)}"}


def test_a_worker_process_two_hours_behind_refuses_to_start(
    settings: Settings, tmp_path: Path
) -> None:
    with workers(settings) as pool:
        (proc,) = pool.start(1, env=skewed_python(tmp_path, -7200))
        proc.join(timeout=60)
        assert proc.exitcode == 2


def test_a_worker_process_two_hours_behind_never_executes_an_expired_approval(
    fleet: Fleet, settings: Settings, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    fleet = with_trust(fleet, approvers_file=trust_file(tmp_path / "a.json", {"alice": ALICE}))
    run_id = run_awaiting_approval(fleet, workspace, "r-fleet-skew")
    pending = inspect_run(fleet, run_id).state.pending
    assert pending is not None
    posted = approve(
        fleet, run_id, pending.action.action_id, key=ALICE, approver_id="alice", ttl_s=1
    )
    expires_ms = posted.evidence.claims.expires_at * 1000  # type: ignore[union-attr]
    poll(
        lambda: fleet.store.server_time_ms() > expires_ms + 1000,
        deadline_s=10,
        what="the approval expired by Redis' clock",
    )
    # A worker allowed to start with a clock this far off, to show what it then does.
    tolerant = fleet.settings.model_copy(update={"max_clock_skew_ms": 3 * 3600 * 1000})
    with workers(tolerant) as pool:
        pool.start(1, env=skewed_python(tmp_path, -7200))
        poll(
            lambda: incident(fleet, run_id, "evidence_refused") is not None,
            deadline_s=60,
            what="the worker refused the expired approval",
        )
    found = incident(fleet, run_id, "evidence_refused")
    assert found is not None and found["reason"] == "expired"
    view = inspect_run(fleet, run_id)
    assert view.state.phase.value == "awaiting_approval" and not view.state.executed
    assert effects(Path(view.document.environment.root)) == 0


def test_a_worker_process_started_before_a_wipe_runs_nothing_after_it(
    fleet: Fleet, settings: Settings, workspace: MakeWorkspace, redis_server: RedisServer
) -> None:
    with workers(settings) as pool:
        pool.start(1)
        _first_root, first_doc = workspace()
        first = submit(fleet, first_doc)
        poll(
            lambda: "finished" in job_outcomes(fleet, first),
            deadline_s=60,
            what="the worker up and done with a run on the old store",
        )
        client = redis_server.client()
        for key in list(client.scan_iter(match="ratchet:*")):  # ratchet's data is gone
            client.delete(key)  # (RQ's queue, on the same Redis here, stays)
        RedisStore(client).identity.init_epoch()  # ... and the store was initialised again
        fresh = Fleet.connect(settings)
        root, document = workspace()
        run_id = submit(fresh, document)
        poll(
            lambda: "store_epoch_changed" in job_outcomes(fresh, run_id),
            deadline_s=60,
            what="the old worker refusing the new store",
        )
    assert effects(root) == 0
    assert fresh.store.read_run(run_id).lease_version == 0
    assert set(job_outcomes(fresh, run_id)) == {"store_epoch_changed"}
