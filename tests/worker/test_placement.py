"""A run's placement (where `ratchet attach` moved it) is signed: a worker routes a run
by one only when it verifies for that very run and document, and refuses the run (an
incident, nothing built) when a stored one does not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratchet.fleet import metrics
from ratchet.fleet.context import Fleet
from ratchet.fleet.placement import Placement, home_of, seal_placement
from ratchet.fleet.runs import document_digest
from ratchet.leasing import LeaseHolder
from ratchet.ops import inspect_run, submit
from ratchet.runtime import KeyRing
from ratchet.worker.job import execute_run
from tests.worker.fleet_harness import poll


def _placement(fleet: Fleet, run_id: str, host: str, **changes: Any) -> Placement:
    view = inspect_run(fleet, run_id)
    base = Placement(
        run_id=run_id,
        document_digest=document_digest(view.document),
        seq=1,
        host=host,
        moved_from=fleet.settings.host,
        env_instance_id=view.state.environment.instance_id,
        env_version=view.state.environment.version,
        by="alice",
        reason="disk moved",
        at_ms=fleet.store.server_time_ms(),
    )
    return base.model_copy(update=changes)


def test_a_verified_placement_routes_the_run_and_a_forged_one_refuses_it(
    fleet: Fleet, workspace: Callable[..., Any]
) -> None:
    _, document = workspace()
    moved = submit(fleet, document, run_id="r-placed")
    view = inspect_run(fleet, moved)
    blob = seal_placement(fleet.keyring, _placement(fleet, moved, "far"))
    fleet.store.hosts.set_placement(moved, blob)
    assert home_of(fleet.keyring, fleet.store, moved, view.document)[0] == "far"
    report = execute_run(fleet, moved, owner="w-here")
    assert report.outcome == "routed" and report.detail == "to host far"
    assert fleet.store.hosts.run_host(moved) == "far" and fleet.store.records.incidents(moved) == []

    # A key ring that shares the fleet's key id but not its key: a forged signature.
    kid = fleet.keyring.signing_kid
    forger = KeyRing.from_secrets({kid: b"f" * 32}, signing_kid=kid)
    for run_id in ("r-forged-key", "r-other-run", "r-junk"):
        _, doc = workspace()
        submit(fleet, doc, run_id=run_id)
        blob: bytes | None = None
        if run_id == "r-forged-key":
            blob = seal_placement(forger, _placement(fleet, run_id, "far"))
        elif run_id == "r-other-run":  # signed properly, but for another run
            blob = seal_placement(fleet.keyring, _placement(fleet, moved, "far"))
        else:  # not an envelope at all
            blob = b'{"host": "far"}'
        assert blob is not None
        fleet.store.hosts.set_placement(run_id, blob)
        report = execute_run(fleet, run_id, owner="w-here")
        assert report.outcome == "restore_refused", (run_id, report)
        incident = fleet.store.records.incidents(run_id)[0]
        assert "placement" in incident["message"], incident


def test_a_routed_job_records_no_takeover_even_when_it_took_an_expired_lease(
    fleet: Fleet, workspace: Callable[..., Any]
) -> None:
    """A run whose worker died with its host: its lease expires, a worker of another host
    takes the job, takes the expired lease over and hands the run on. Nothing is recorded
    against the run (docs/hosts.md), while the worker's counters keep the takeover (the
    lease was taken); a takeover of a run that lives here is recorded as before."""
    _, document = workspace()
    far = submit(fleet, document, run_id="r-far-dead")
    blob = seal_placement(fleet.keyring, _placement(fleet, far, "far"))
    fleet.store.hosts.set_placement(far, blob)
    _, document = workspace()
    here = submit(fleet, document, run_id="r-here-dead")
    for run_id in (far, here):
        dead = fleet.store.try_acquire(run_id, owner="w-died-with-its-host", ttl_ms=60)
        assert not isinstance(dead, LeaseHolder)
        poll(lambda r=run_id: not fleet.store.read_run(r).lease_live, deadline_s=30, what="expiry")
    before = metrics.LEASES_TAKEN_OVER._value.get()
    report = execute_run(fleet, far, owner="w-here")
    assert report.outcome == "routed", report
    assert fleet.store.records.incidents(far) == []
    assert metrics.LEASES_TAKEN_OVER._value.get() == before + 1
    report = execute_run(fleet, here, owner="w-here")
    assert report.outcome != "routed", report
    assert "lease_taken_over" in {i["kind"] for i in fleet.store.records.incidents(here)}
    assert metrics.LEASES_TAKEN_OVER._value.get() == before + 2
