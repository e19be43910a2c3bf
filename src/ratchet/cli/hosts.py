"""``ratchet attach``: move a run whose host is gone to this host (docs/hosts.md)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ratchet.cli.common import JsonFlag, app, print_json, ratchet_errors
from ratchet.fleet.context import Fleet
from ratchet.ops import attach as attach_run

__all__: list[str] = []


def _operator() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"


@app.command("attach")
@ratchet_errors
def attach_command(
    run_id: str,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded with the run).")],
    as_json: JsonFlag = False,
) -> None:
    """Move a run whose host is gone to this host (RATCHET_HOST), once its workspace is
    proven to be here: observed from this host's disk at the path its document names,
    it must be the run's own environment (same instance, the version the run recorded).
    A signed placement then names this host and the run is enqueued here."""
    operator = _operator()
    attached = attach_run(Fleet.connect(), run_id, reason=reason, operator=operator)
    placement = attached.placement
    info = {
        "run_id": run_id,
        "host": placement.host,
        "moved_from": placement.moved_from,
        "seq": placement.seq,
        "env_instance_id": placement.env_instance_id,
        "env_version": placement.env_version,
        "operator": operator,
    }
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"{run_id} moved from host {placement.moved_from} to {placement.host} by "
            f"{operator} (environment {placement.env_instance_id} at version "
            f"{placement.env_version}); run enqueued here"
        )
