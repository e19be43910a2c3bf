"""``ratchet console``: the read-only web console (see :mod:`ratchet.console`)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

import typer

from ratchet.cli.common import app, ratchet_errors
from ratchet.cli.render import run_summary, run_to_json
from ratchet.console import ConsoleData, serve_console
from ratchet.worker.context import Fleet
from ratchet.worker.ops import inspect_run

__all__ = ["fleet_console_data"]


def fleet_console_data(fleet: Fleet, *, limit: int = 500) -> ConsoleData:
    """The console's data: the rows of ``ratchet runs`` and the view of ``ratchet show``."""

    def list_runs(n: int) -> list[dict[str, Any]]:
        return [run_summary(fleet, run_id) for run_id in fleet.store.run_ids(limit=n)]

    def run_detail(run_id: str, now: int) -> dict[str, Any]:
        return run_to_json(inspect_run(fleet, run_id), now)

    return ConsoleData(list_runs=list_runs, run_detail=run_detail, limit=limit)


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
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="Runs listed.")] = 500,
    allow_host: Annotated[list[str] | None, typer.Option(
        "--allow-host", help="Another Host name to answer (NAME or NAME:PORT), e.g. the "
        "one a reverse proxy forwards; repeat for more.")] = None,
) -> None:
    """Serve the read-only web console: runs, a run's evidence, the review queue.

    No signing and no write endpoint: the pages show the exact `ratchet approve` /
    `ratchet review` command to run where the private key is. The console has no login;
    keep it on loopback (the default) and reach it through an SSH tunnel. It answers
    only requests whose Host header names it (DNS rebinding gets 421).
    """
    if not _is_loopback(host):
        typer.echo(f"ratchet: warning: the console has no authentication and is listening "
                   f"on {host}; anyone who can reach it sees every run", err=True)
    server = serve_console(fleet_console_data(Fleet.connect(), limit=limit), host=host,
                           port=port, allowed_hosts=allow_host or ())
    typer.echo(f"ratchet console on {server.url} (read-only; Ctrl+C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
