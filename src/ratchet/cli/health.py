"""``ratchet health``: are this host's worker processes alive and registered? (A container
healthcheck: docker-compose.yml runs it in each worker container.)

A worker process counts when RQ has it registered on the configured queue (RQ refreshes a
registration with every heartbeat and drops it ``worker_ttl`` after the last one) from this
host name, and its pid is a live process here. A SIGKILLed worker keeps its registration
until that expiry, so the pid check is what notices it at once. Exit code 0: at least
``--min-workers`` count; 1: fewer (one line on stderr says how many); 2: a configuration
or store error (as every command).
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from redis.exceptions import RedisError
from rq import Worker
from rq.serializers import JSONSerializer

from ratchet.cli.common import EXIT_CHECK_FAILED, JsonFlag, app, print_json, ratchet_errors
from ratchet.errors import StoreUnavailableError
from ratchet.fleet.context import Fleet

__all__ = ["local_workers"]


def _alive(pid: int | None) -> bool:
    if pid is None or pid <= 0:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc here: existence is all that can be told
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state != "Z"


def local_workers(fleet: Fleet, hostname: str | None = None) -> list[dict[str, Any]]:
    """The RQ workers registered on the fleet's queue from ``hostname`` (this host by
    default): name, pid, state, seconds since the last heartbeat, and whether the pid is
    a live process here.

    Raises StoreUnavailableError.
    """
    host = hostname or socket.gethostname()
    try:
        workers = Worker.all(queue=fleet.queue, serializer=JSONSerializer)
    except RedisError as exc:
        raise StoreUnavailableError(
            f"cannot read RQ's worker registry: {type(exc).__name__}"
        ) from None
    now = datetime.now(UTC)
    out = []
    for worker in workers:
        if worker.hostname != host:
            continue
        beat = worker.last_heartbeat
        if beat is not None and beat.tzinfo is None:
            beat = beat.replace(tzinfo=UTC)
        out.append(
            {
                "name": worker.name,
                "pid": worker.pid,
                "state": str(worker.get_state()),
                "heartbeat_age_s": None if beat is None else round((now - beat).total_seconds(), 1),
                "alive": _alive(worker.pid),
            }
        )
    return sorted(out, key=lambda w: str(w["name"]))


@app.command("health")
@ratchet_errors
def health_command(
    min_workers: Annotated[
        int, typer.Option(min=1, max=64, help="How many live worker processes this host must have.")
    ] = 1,
    as_json: JsonFlag = False,
) -> None:
    """Exit 0 when this host has at least MIN_WORKERS live worker processes registered on
    the queue, 1 when it has fewer (a container healthcheck)."""
    fleet = Fleet.connect()  # the store must answer and be the same store (its epoch)
    workers = local_workers(fleet)
    alive = sum(1 for w in workers if w["alive"])
    healthy = alive >= min_workers
    if as_json:
        print_json(
            {
                "healthy": healthy,
                "alive": alive,
                "min_workers": min_workers,
                "queue": fleet.settings.queue,
                "workers": workers,
            }
        )
    elif healthy:
        typer.echo(f"healthy: {alive} live worker processes on queue {fleet.settings.queue}")
    if not healthy:
        if not as_json:
            typer.echo(
                f"ratchet: unhealthy: {alive} live worker processes of this host on "
                f"queue {fleet.settings.queue}, at least {min_workers} needed",
                err=True,
            )
        raise typer.Exit(EXIT_CHECK_FAILED)
