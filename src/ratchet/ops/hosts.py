"""Host-bound runs and their hosts: moving a run whose host is gone.

:func:`attach` is the operator's "attach the same environment elsewhere" (docs/hosts.md):
proven by the environment's own instance id and version, observed from the new host's
disk, recorded as a signed placement (:mod:`ratchet.fleet.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ratchet.errors import CheckpointError, ContractError
from ratchet.fleet.context import Fleet
from ratchet.fleet.placement import Placement, home_of, seal_placement
from ratchet.fleet.runs import document_digest
from ratchet.ops.operations import inspect_run, observe_now
from ratchet.runtime import Observation
from ratchet.runtime.restore import check_environment
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = ["Attached", "attach"]


@dataclass(frozen=True, slots=True)
class Attached:
    """A run moved to this host: the signed placement, and the environment observed here
    that proved it (the run's own instance, at the version it recorded)."""

    placement: Placement
    observed: Observation


def attach(fleet: Fleet, run_id: str, *, reason: str, operator: str) -> Attached:
    """Move a run whose host is gone to this process's host, once its environment is
    proven to be here: observed from this host's disk (at the path its signed document
    names), it must be the run's own instance at the version the run recorded (or the
    one-commit state of its pending write), as a restore would check. Then a placement
    (signed, numbered, bound to the run and its document) names this host, the routing
    hint follows, an incident records the move, and the run is enqueued here.

    Raises ContractError (an ended run, a run bound to no host or to this one, its host
    still alive, a live lease, an environment here that is not the run's: another
    instance, another state, one behind the run's record), ConfigurationError (no
    workspace here), IntegrityError (a stored placement that does not verify), and what
    :func:`inspect_run` raises.
    """
    view = inspect_run(fleet, run_id)
    state, document = view.state, view.document
    if state.phase in TERMINAL_PHASES:
        raise ContractError(f"the run is {state.phase.value}; nothing to attach", run_id=run_id)
    home, before = home_of(fleet.keyring, fleet.store, run_id, document)
    here = fleet.settings.host
    if home is None:
        raise ContractError(
            "the run is bound to no host (any worker takes it); nothing to attach",
            run_id=run_id,
        )
    if home == here:
        raise ContractError(f"the run already lives on this host ({here})", run_id=run_id)
    seen = fleet.host_seen(home)
    if seen.alive:
        raise ContractError(
            f"the run's {seen.describe()} is alive: stop its workers (and detach its disk) "
            "before the run moves",
            run_id=run_id,
        )
    if view.snapshot.lease_live:
        raise ContractError(
            f"a worker holds the run ({view.snapshot.owner}); wait for its lease to end",
            run_id=run_id,
        )
    observed = observe_now(fleet, view)
    try:
        check_environment(state, observed)
    except CheckpointError as exc:
        raise ContractError(
            f"the environment here is not the run's as it recorded it: {exc.message}",
            run_id=run_id,
        ) from None
    placement = Placement(
        run_id=run_id,
        document_digest=document_digest(document),
        seq=(before.seq + 1) if before is not None else 1,
        host=here,
        moved_from=home,
        env_instance_id=observed.instance_id,
        env_version=observed.version,
        by=operator,
        reason=reason,
        at_ms=fleet.store.server_time_ms(),
    )
    fleet.store.hosts.set_placement(run_id, seal_placement(fleet.keyring, placement))
    fleet.store.hosts.set_run_host(run_id, here)
    fleet.store.records.record_incident(
        run_id,
        {
            "kind": "placement_moved",
            "from": home,
            "to": here,
            "by": operator,
            "reason": reason[:500],
            "seq": placement.seq,
            "env_instance_id": observed.instance_id,
            "env_version": observed.version,
            "message": f"moved from host {home} to {here} by {operator}",
        },
    )
    fleet.enqueue(run_id, host=here)
    return Attached(placement, observed)
