"""The reaper: re-enqueue runs whose lease expired while work remained.

Choice: every worker process runs a reaper thread (no dedicated process to deploy, watch
or lose). Each tick, every ``reaper_interval_ms``:

1. read the expiry index (run id scored by lease expiry, Redis time) for entries at or
   before Redis' now. A run is on the index while a worker holds it, and stays there if
   that worker dies; a worker that finishes, or waits for a human, takes it off;
2. for each: ``claim_reap`` on the run's own lease hash. Exactly one reaper wins per lease
   version, so a run is never enqueued twice for the same lease expiry;
3. the winner enqueues ``{run_id}``, then drops the index entry only if its score is still
   the one it read (a worker that re-acquired the run meanwhile re-scored it, and its entry
   must stay).

Bound: a run whose worker died is re-enqueued at most ``lease TTL + reaper interval`` (plus
one Redis round trip) after the worker's last renewal, whichever worker's reaper ticks first.
A reaper that dies between its claim and its enqueue leaves the entry on the index; after
``reclaim_after_ms`` another reaper may claim it again.

Hosts. Each tick also reports this process's host as alive (``RedisStore.hosts.note``).
A run bound to a host (its workspace is on that host's disk) goes to that host's queue
(``Fleet.enqueue`` reads the run's routing hint); while no worker of that host has been
seen for ``host_timeout_ms`` the reaper does not hand it on (its queue has nobody to
serve it, and a job per pickup deadline would only pile up there): the entry is parked
and looked at again later, nothing is recorded as a fault, and the run shows as waiting
for its host (:class:`HostGate`). Once a worker of the host reports in again, the next
look hands the run to its queue.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ratchet.errors import ContractError, RatchetError, StoreUnavailableError
from ratchet.fleet import metrics
from ratchet.leasing import RedisStore

__all__ = ["HostGate", "ReapResult", "Reaper", "reap_once"]

log = logging.getLogger("ratchet.worker.reaper")


@dataclass(frozen=True, slots=True)
class ReapResult:
    examined: int
    enqueued: tuple[str, ...]
    parked: tuple[str, ...] = ()
    held: tuple[str, ...] = ()


class HostGate:
    """Whether a run's host can take it now: refreshed once per tick from the store's
    host records (one read), then asked per entry (one read of the run's routing hint)."""

    def __init__(self, store: RedisStore, *, timeout_ms: int) -> None:
        self._store = store
        self._timeout_ms = timeout_ms
        self._seen: dict[str, int] = {}
        self._now_ms = 0

    def refresh(self) -> None:
        """Read when every host was last seen (and set the last-seen gauge).

        Raises StoreUnavailableError.
        """
        self._seen, self._now_ms = self._store.hosts.seen()
        for host, at_ms in self._seen.items():
            metrics.HOST_LAST_SEEN.labels(host=host).set(max(self._now_ms - at_ms, 0) / 1000)

    def hold(self, run_id: str) -> str | None:
        """Why ``run_id`` must wait for its host (None: hand it on)."""
        host = self._store.hosts.run_host(run_id)
        if host is None:
            return None
        seen = self._seen.get(host)
        if seen is not None and self._now_ms - seen <= self._timeout_ms:
            return None
        if seen is None:
            return f"waiting for host {host} (no worker of it seen)"
        return f"waiting for host {host} (last seen {(self._now_ms - seen) // 1000} s ago)"


PARK_MS = 60_000  # how long an entry the reaper could not handle waits before a retry


def reap_once(
    store: RedisStore,
    enqueue: Callable[[str], object],
    *,
    limit: int = 100,
    reclaim_after_ms: int = 30_000,
    park_ms: int = PARK_MS,
    hold: Callable[[str], str | None] | None = None,
) -> ReapResult:
    """One reaper tick. Errors are handled per entry: an entry that cannot be handled
    (a run whose lease record is not what the scripts wrote, an id that is not one) is
    recorded, counted and parked ``park_ms`` later, so it never blocks the entries behind
    it and the fleet keeps taking over dead workers' runs. ``hold`` says why a run must
    wait (its host is gone): its entry is parked ``park_ms`` later without a claim or a
    record, and looked at again then.

    Raises StoreUnavailableError when Redis cannot be read (the tick is retried).
    """
    entries = store.expiry.expired_entries(limit=limit)
    enqueued: list[str] = []
    parked: list[str] = []
    held: list[str] = []
    for run_id, score in entries:
        try:
            reason = hold(run_id) if hold is not None else None
            if reason is not None:
                store.expiry.park_expiry_entry(run_id, for_ms=park_ms)
                metrics.REAPER_HELD.inc()
                log.info("held for its host", extra={"run_id": run_id, "reason": reason})
                held.append(run_id)
                continue
            if _reap_entry(store, enqueue, run_id, score, reclaim_after_ms):
                enqueued.append(run_id)
        except StoreUnavailableError:
            raise
        except ContractError:
            # Not a run id at all (junk written into the index): it names no run.
            with contextlib.suppress(RatchetError):
                store.expiry.forget_index_member(run_id)
            metrics.REAPER_BAD_ENTRIES.inc()
        except RatchetError as exc:
            _park(store, run_id, exc, park_ms)
            parked.append(run_id)
    return ReapResult(len(entries), tuple(enqueued), tuple(parked), tuple(held))


def _reap_entry(
    store: RedisStore,
    enqueue: Callable[[str], object],
    run_id: str,
    score: int,
    reclaim_after_ms: int,
) -> bool:
    claim = store.claim_reap(run_id, reclaim_after_ms=reclaim_after_ms)
    if claim.status == "no_run":
        store.expiry.drop_expiry_entry(run_id, score)
        return False
    if not claim.claimed:
        return False
    enqueue(run_id)
    store.expiry.drop_expiry_entry(run_id, score)
    cause, generation = _cause(store, run_id)
    metrics.REAPER_REQUEUES.labels(cause=cause).inc()
    log.info(
        "re-enqueued",
        extra={
            "run_id": run_id,
            "cause": cause,
            "lease_version": claim.lease_version,
            "generation": generation,
        },
    )
    return True


def _park(store: RedisStore, run_id: str, exc: RatchetError, park_ms: int) -> None:
    metrics.REAPER_BAD_ENTRIES.inc()
    log.error(
        "reaper cannot handle an entry; parked",
        extra={"run_id": run_id, "error": type(exc).__name__},
    )
    with contextlib.suppress(RatchetError):
        store.records.record_incident(
            run_id,
            {
                "kind": "reaper_entry_refused",
                "reason": type(exc).__name__,
                "message": exc.message[:500],
            },
        )
    with contextlib.suppress(RatchetError):
        store.expiry.park_expiry_entry(run_id, for_ms=park_ms)


def _cause(store: RedisStore, run_id: str) -> tuple[str, int | None]:
    """Why a re-enqueued run was on the index: its holder let the lease expire (the owner
    is still named: it died, stalled or was paused) or released it for reaping. For
    metrics and logs only; never raises."""
    try:
        snap = store.read_run(run_id)
    except RatchetError:
        return "unknown", None
    return ("lease_expired" if snap.owner else "released"), snap.generation


class Reaper:
    """A daemon thread running :func:`reap_once` every ``interval_ms``."""

    def __init__(
        self,
        store: RedisStore,
        enqueue: Callable[[str], object],
        *,
        interval_ms: int,
        reclaim_after_ms: int = 30_000,
        host: str | None = None,
        host_timeout_ms: int = 30_000,
    ) -> None:
        self._store = store
        self._enqueue = enqueue
        self._host = host
        self._gate = HostGate(store, timeout_ms=host_timeout_ms)
        self._interval = interval_ms / 1000
        self._reclaim_after_ms = reclaim_after_ms
        self._stop = threading.Event()
        self.enqueued = 0
        self._thread = threading.Thread(target=self._loop, name="ratchet-reaper", daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(2 * self._interval, 1.0))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if self._host is not None:
                    self._store.hosts.note(self._host)
                self._gate.refresh()
                result = reap_once(
                    self._store,
                    self._enqueue,
                    reclaim_after_ms=self._reclaim_after_ms,
                    hold=self._gate.hold,
                )
            except RatchetError as exc:
                log.warning("reaper tick failed", extra={"error": type(exc).__name__})
                continue
            unreadable = self._store.expiry.expiry_shards_unreadable
            if unreadable:
                # A master is down (Cluster): the runs of its shards wait for it.
                log.warning("reaper tick read part of the index", extra={"unreadable": unreadable})
            # Phase moves this process could not index while a master was down (Cluster).
            with contextlib.suppress(RatchetError):
                self._store.repair_deferred_moves()
            self.enqueued += len(result.enqueued)
