"""``ratchet console``: the read-only web console (see :mod:`ratchet.console`)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

import typer
from redis.exceptions import RedisError

from ratchet.cli.common import app, ratchet_errors
from ratchet.cli.render import run_summary, run_to_json
from ratchet.console import ConsoleData, serve_console
from ratchet.console.data import RunQuery
from ratchet.errors import ContractError, RunNotFoundError, StoreUnavailableError
from ratchet.fleet.context import Fleet
from ratchet.leasing.keyspace import check_id
from ratchet.leasing.listing import MAX_PAGE
from ratchet.ops import inspect_run
from ratchet.ops.queueview import list_workers

__all__ = ["fleet_console_data", "page_runs", "queue_depth", "run_exists"]


def page_runs(fleet: Fleet, query: RunQuery) -> tuple[list[dict[str, Any]], str | None, int]:
    """One page of ``ratchet runs`` (and of the console's list): summary rows from the
    store's indexes, the next cursor, and how many runs were examined. Nothing verified.

    Raises ContractError (unknown phase, bad limit or cursor), StoreUnavailableError.
    """
    store = fleet.store
    if query.search:
        page = store.search_runs(
            query.search,
            query.phase,
            limit=query.limit,
            after=query.after,
            oldest_first=query.oldest_first,
        )
    else:
        page = store.list_runs(
            query.phase, limit=query.limit, after=query.after, oldest_first=query.oldest_first
        )
    seen, now_ms = store.hosts.seen()
    alive = {h: now_ms - at <= fleet.settings.host_timeout_ms for h, at in seen.items()}
    rows = [run_summary(row, page.now_ms, alive) for row in page.rows]
    return rows, page.next_cursor, page.scanned


def queue_depth(fleet: Fleet) -> int:
    """Jobs waiting in the fleet's RQ queues: the shared one and every known host's.
    Raises StoreUnavailableError."""
    try:
        return sum(int(fleet.rq_connection.llen(queue.key)) for queue in fleet.all_queues())
    except RedisError as exc:
        raise StoreUnavailableError("the queue cannot be read", cause=type(exc).__name__) from None


def run_exists(fleet: Fleet, run_id: str) -> bool:
    """Whether ``run_id`` names a run (an invalid id names none). Raises
    StoreUnavailableError."""
    try:
        fleet.store.read_run(check_id(run_id, "run_id"))
    except (RunNotFoundError, ContractError):
        return False
    return True


def fleet_console_data(fleet: Fleet, *, limit: int = 500) -> ConsoleData:
    """The console's data: the pages and counts of ``ratchet runs``, the view of ``ratchet
    show --json``, the workers RQ knows and the queue's depth."""

    def list_runs(n: int) -> list[dict[str, Any]]:
        """The newest ``n`` runs' summary rows."""
        rows: list[dict[str, Any]] = []
        after = None
        while len(rows) < n:
            page, after, _ = page_runs(
                fleet, RunQuery(limit=min(MAX_PAGE, n - len(rows)), after=after)
            )
            rows += page
            if after is None:
                break
        return rows

    def count_runs() -> tuple[dict[str, int], int]:
        return fleet.store.phase_counts(), fleet.store.run_count()

    def run_detail(run_id: str, now: int) -> dict[str, Any]:
        return run_to_json(inspect_run(fleet, run_id), now, fleet=fleet)

    return ConsoleData(
        list_runs=list_runs,
        run_detail=run_detail,
        limit=limit,
        list_workers=lambda: list_workers(fleet),
        page_runs=lambda query: page_runs(fleet, query),
        count_runs=count_runs,
        queue_depth=lambda: queue_depth(fleet),
        run_exists=lambda run_id: run_exists(fleet, run_id),
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@app.command("console")
@ratchet_errors
def console_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: any free).")] = 8765,
    limit: Annotated[
        int,
        typer.Option(
            min=1,
            max=10_000,
            help=(
                "Newest runs read by a view that needs a whole list; the runs list and the "
                "review queue page through the indexes instead."
            ),
        ),
    ] = 500,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            help="Another Host name to answer (NAME or NAME:PORT), e.g. the "
            "one a reverse proxy forwards; repeat for more.",
        ),
    ] = None,
) -> None:
    """Serve the read-only web console: runs, a run's evidence, the review queue.

    No signing and no write endpoint: the pages show the exact `ratchet approve` /
    `ratchet review` command to run where the private key is. The console has no login;
    keep it on loopback (the default) and reach it through an SSH tunnel. It answers
    only requests whose Host header names it (DNS rebinding gets 421).
    """
    if not _is_loopback(host):
        typer.echo(
            f"ratchet: warning: the console has no authentication and is listening "
            f"on {host}; anyone who can reach it sees every run",
            err=True,
        )
    server = serve_console(
        fleet_console_data(Fleet.connect(), limit=limit),
        host=host,
        port=port,
        allowed_hosts=allow_host or (),
    )
    typer.echo(f"ratchet console on {server.url} (read-only; Ctrl+C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
