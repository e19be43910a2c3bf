"""Put every run in its phase's index, and in that one alone: runs created before phase
indexes existed, runs a Redis Cluster crash window or outage left listed under an old
phase, and (Cluster) the entries of a store written before the indexes were sharded.

A run created before phase indexes records no phase in its state hash, so no phase list
shows it (the list of all runs does). :func:`index_phases` reads such a run's phase from
its verified checkpoint (:func:`ratchet.ops.inspect_run`) and records it
(:meth:`ratchet.leasing.RedisStore.record_phase`); a run whose phase is recorded but
missing from its index, or listed under another phase too, is listed under its own alone
without reading the checkpoint. On a Cluster the one-key indexes of an older store are
moved into their shards first
(:meth:`ratchet.leasing.RedisStore.migrate_unsharded_indexes`). A run that does not
verify is left out and counted: it stays in the list of all runs, where its own page says
why. ``ratchet store init`` runs this; running it again finds nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ratchet.errors import RatchetError
from ratchet.fleet.context import Fleet
from ratchet.ops.operations import inspect_run

__all__ = ["IndexReport", "index_phases"]


@dataclass
class IndexReport:
    """What :func:`index_phases` did: index entries moved into their shards, runs
    indexed, runs a commit indexed first, and runs left out with the reason (run id ->
    message)."""

    migrated: int = 0
    indexed: int = 0
    already: int = 0
    unverifiable: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "migrated": self.migrated,
            "indexed": self.indexed,
            "already": self.already,
            "unverifiable": dict(sorted(self.unverifiable.items())),
        }


def index_phases(fleet: Fleet) -> IndexReport:
    """Index every run of the runs index that no phase index lists (see the module
    docstring). Raises StoreUnavailableError."""
    report = IndexReport(migrated=fleet.store.migrate_unsharded_indexes())
    for run_id, recorded in fleet.store.runs_missing_phase():
        phase = recorded
        if not phase:
            try:
                phase = inspect_run(fleet, run_id).state.phase.value
            except RatchetError as exc:
                report.unverifiable[run_id] = exc.message
                continue
        if fleet.store.record_phase(run_id, phase):
            report.indexed += 1
        else:
            report.already += 1  # a commit recorded its phase meanwhile
    return report
