"""Retention commands: ``ratchet export``, ``ratchet verify`` and ``ratchet purge``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from ratchet.cli.common import JsonFlag, app, print_json, ratchet_errors
from ratchet.errors import ConfigurationError, ContractError
from ratchet.fleet.context import Fleet, load_keyring
from ratchet.fleet.settings import Settings
from ratchet.ops.retention import MAX_EXPORT_BYTES, purge_finished, verify_export, write_export

__all__ = ["parse_duration"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_DURATION = re.compile(r"(\d{1,9})([smhdw])")


def parse_duration(text: str) -> int:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w`` (or a sum: ``1d12h``) in milliseconds.
    Raises ContractError."""
    text = text.strip().lower()
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ContractError(
            f"bad duration {text[:40]!r}: use e.g. 90s, 15m, 12h, 30d, 2w", field="finished_before"
        )
    return sum(int(n) * _UNITS[u] for n, u in parts) * 1000


@app.command("export")
@ratchet_errors
def export_command(
    run_id: str,
    out: Annotated[
        Path | None, typer.Option("--out", help="File to write (default: RUN.ratchet-export here).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a run's signed checkpoint, archive, document, history and incidents as one
    file, sealed under the fleet's key ring, that `ratchet verify` checks offline."""
    path = out or Path(f"{run_id.replace('/', '_')}.ratchet-export")
    summary = write_export(Fleet.connect(), run_id, path)
    info = {**summary.as_dict(), "file": str(path)}
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"exported {run_id} ({summary.phase}, generation {summary.generation}) to {path}"
        )


@app.command("verify")
@ratchet_errors
def verify_command(file: Path, as_json: JsonFlag = False) -> None:
    """Check an export file offline with the key ring (RATCHET_CHECKPOINT_KEY or
    RATCHET_CHECKPOINT_KEYS_FILE; no store is contacted): the file's seal, the document,
    the checkpoint and its archive as a restore checks them. Exits 2 if it does not
    verify."""
    try:
        if file.stat().st_size > MAX_EXPORT_BYTES:
            raise ContractError("the file is larger than any export", field="file")
        blob = file.read_bytes()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read {file}: {exc.strerror or exc}", field="file"
        ) from None
    summary = verify_export(load_keyring(Settings()), blob)
    if as_json:
        print_json(summary.as_dict())
    else:
        typer.echo(
            f"{file}: verified: run {summary.run_id}, {summary.phase}, generation "
            f"{summary.generation}, {summary.executed} executed writes"
        )


@app.command("purge")
@ratchet_errors
def purge_command(
    finished_before: Annotated[
        str,
        typer.Option(
            "--finished-before",
            help="Purge runs that finished longer ago than this (90s, 15m, 12h, 30d, 2w).",
        ),
    ],
    export_dir: Annotated[
        Path | None, typer.Option("--export-dir", help="Export each run here before it is removed.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 1000,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove finished runs (completed, failed, cancelled) from the store, leaving a small
    tombstone per run so its id, keys and nonces are never reused. A run that is not
    finished, does not verify, is held, or has an unconsumed approval or decision is
    kept, with the reason."""
    report = purge_finished(
        Fleet.connect(),
        older_than_ms=parse_duration(finished_before),
        export_dir=export_dir,
        limit=limit,
        dry_run=dry_run,
    )
    if as_json:
        print_json(report.as_dict())
        return
    verb = "would purge" if dry_run else "purged"
    typer.echo(
        f"{verb} {len(report.purged)} runs"
        + (f", exported to {export_dir}" if export_dir and report.exported else "")
        + f"; kept {len(report.kept)}"
    )
    for run_id, why in sorted(report.kept.items())[:50]:
        typer.echo(f"  kept {run_id}: {why}")
