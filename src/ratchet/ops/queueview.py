"""The queue and the workers as RQ records them: what waits, what runs, who is alive.

RQ keeps, in Redis, the queue (a list of job ids), the jobs being executed (its started
job registry) and a registry of workers with their state, current job and last heartbeat.
A ratchet job's description is ``ratchet run <run_id>`` (:meth:`ratchet.fleet.context.
Fleet.enqueue`), which is how a job is tied back to its run without loading its payload;
a worker's name is ``<owner id>-<index>`` (:func:`ratchet.worker.pool.worker_main`), which
is how it is tied to the lease owner ids the runs show.

Reads only, bounded: at most :data:`SCAN_JOBS` queued or started jobs are looked at. The
worker list reads RQ's worker registry and loads only the workers whose record still
exists (``rq.Worker.all`` would also drop the registry entry of one whose record expired:
a write, which a read-only view must not make).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from rq import Worker, worker_registration
from rq.job import Job
from rq.serializers import JSONSerializer

from ratchet.errors import StoreUnavailableError
from ratchet.fleet.context import Fleet

__all__ = ["SCAN_JOBS", "QueueFacts", "list_workers", "owner_of_worker", "queue_facts"]

SCAN_JOBS = 1000
_DESCRIPTION = re.compile(r"ratchet run (\S+)")
# ``<name>-<12 hex incarnation>-<pid>-<index>``: see ratchet.fleet.identity.
_WORKER_NAME = re.compile(r"(.+-[0-9a-f]{12}-[0-9]+)-[0-9]+")


def owner_of_worker(name: str) -> str | None:
    """The lease owner id of the ratchet worker named ``name``, or None when the name is
    not one a ratchet worker process gives itself."""
    match = _WORKER_NAME.fullmatch(name)
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class QueueFacts:
    """The queue at one moment: its depth, where each scanned run waits, which runs RQ
    says are executing (run id -> worker name), and whether every job was scanned."""

    queue: str
    depth: int
    positions: dict[str, int]
    started: dict[str, str]
    complete: bool


def _descriptions(fleet: Fleet, job_ids: list[str]) -> list[tuple[str | None, str]]:
    """``(run id, worker name)`` of each job (None for a job that is not a run's)."""
    pipe = fleet.rq_connection.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hmget(Job.key_for(job_id), "description", "worker_name")
    out: list[tuple[str | None, str]] = []
    for description, worker in pipe.execute():
        text = description.decode("utf-8", "replace") if isinstance(description, bytes) else ""
        match = _DESCRIPTION.fullmatch(text)
        name = worker.decode("utf-8", "replace") if isinstance(worker, bytes) else ""
        out.append((match.group(1) if match else None, name))
    return out


def queue_facts(fleet: Fleet, host: str | None = None) -> QueueFacts:
    """Read the queue (``host``'s, or the shared one) and its started job registry.
    Raises StoreUnavailableError."""
    queue = fleet.queue if host is None else fleet.host_queue(host)
    try:
        depth = int(fleet.rq_connection.llen(queue.key))
        waiting = [
            i.decode() if isinstance(i, bytes) else str(i)
            for i in fleet.rq_connection.lrange(queue.key, 0, SCAN_JOBS - 1)
        ]
        started_ids = queue.started_job_registry.get_job_ids(0, SCAN_JOBS - 1, cleanup=False)
        positions: dict[str, int] = {}
        for index, (run_id, _) in enumerate(_descriptions(fleet, waiting)):
            if run_id is not None:
                positions.setdefault(run_id, index + 1)
        started = {
            run_id: worker
            for run_id, worker in _descriptions(fleet, started_ids)
            if run_id is not None
        }
    except redis.RedisError as exc:
        raise StoreUnavailableError("the queue cannot be read", cause=type(exc).__name__) from None
    return QueueFacts(
        queue.name,
        depth,
        positions,
        started,
        complete=depth <= SCAN_JOBS and len(started_ids) < SCAN_JOBS,
    )


def _age_s(then: datetime | None, now_ms: int) -> float | None:
    if then is None:
        return None
    moment = then if then.tzinfo is not None else then.replace(tzinfo=UTC)
    return round(max(now_ms / 1000 - moment.timestamp(), 0.0), 1)


def list_workers(fleet: Fleet) -> dict[str, Any]:
    """The workers RQ knows for the fleet's queue, with the depth of every queue of the
    fleet (the shared one and each host's).

    ``{"queue", "queue_depth", "now_ms", "workers": [{name, owner, state, current_job,
    current_run, last_heartbeat, heartbeat_age_s, queues, successful_jobs, failed_jobs}]}``;
    ages are measured against the store's clock (RQ stamps heartbeats with the worker's
    own clock, so a skewed worker shows a skewed age). Raises StoreUnavailableError.
    """
    facts = queue_facts(fleet)
    # A worker runs jobs from its host's queue too: what every host's queue says is
    # running joins the shared queue's.
    started = dict(facts.started)
    try:
        queues = fleet.all_queues()[1:]
    except redis.RedisError as exc:
        raise StoreUnavailableError("the queues cannot be read", cause=type(exc).__name__) from None
    prefix = f"{fleet.settings.queue}@"
    depth = facts.depth
    for queue in queues:
        host_facts = queue_facts(fleet, queue.name[len(prefix) :])
        started.update(host_facts.started)
        depth += host_facts.depth
    now_ms = fleet.store.server_time_ms()
    try:
        connection = fleet.queue.connection
        found = [
            worker
            for key in worker_registration.get_keys(queue=fleet.queue)
            if connection.exists(key)
            and (
                worker := Worker.find_by_key(key, connection=connection, serializer=JSONSerializer)
            )
            is not None
        ]
        rows = []
        running = {worker: run_id for run_id, worker in started.items()}
        for worker in sorted(found, key=lambda w: w.name):
            heartbeat = getattr(worker, "last_heartbeat", None)
            rows.append(
                {
                    "name": worker.name,
                    "owner": owner_of_worker(worker.name),
                    "state": str(worker.get_state()),
                    "current_job": worker.get_current_job_id(),
                    "current_run": running.get(worker.name),
                    "last_heartbeat": heartbeat.isoformat() if heartbeat else None,
                    "heartbeat_age_s": _age_s(heartbeat, now_ms),
                    "queues": [q.name for q in getattr(worker, "queues", [])],
                    "successful_jobs": int(getattr(worker, "successful_job_count", 0) or 0),
                    "failed_jobs": int(getattr(worker, "failed_job_count", 0) or 0),
                }
            )
    except redis.RedisError as exc:
        raise StoreUnavailableError(
            "the worker registry cannot be read", cause=type(exc).__name__
        ) from None
    return {"queue": facts.queue, "queue_depth": depth, "now_ms": now_ms, "workers": rows}
