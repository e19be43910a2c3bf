"""Retention commands: ``ratchet export``, ``ratchet verify`` and ``ratchet purge``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from ratchet.cli.common import JsonFlag, app, print_json, ratchet_errors
from ratchet.errors import ConfigurationError, ContractError
from ratchet.fleet.context import Fleet, load_keyring, load_trust_roots
from ratchet.fleet.settings import Settings
from ratchet.ops.retention import (
    MAX_EXPORT_BYTES,
    ExportSummary,
    purge_finished,
    verify_export,
    write_export,
)
from ratchet.ops.vouching import clean

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


_NAMES = {"consumed_nonces": "consumed nonces"}
_SHOWN_RECORDS = 50  # per part; --json lists every record


def _echo_parts(summary: ExportSummary, *, records: bool = True) -> None:
    """Say, part by part, what an export vouches for, and (``records``) list each record
    it does not vouch for (a record pushed into Redis by hand is one of them), but for
    the history's commit entries, which are all unsigned: counted here, listed by --json
    (the text never shows them, so never as fact)."""
    for part in summary.parts:
        name = _NAMES.get(part.name, part.name)
        verdict = "vouched for" if part.vouched else "NOT vouched for"
        typer.echo(f"  {name:<16} {verdict}: {part.by}")
        if not records:
            continue
        history = part.name == "history"
        commits = sum(r.kind == "commit" for r in part.records) if history else 0
        if commits:
            typer.echo(f"    {commits} commit entries, unsigned (listed by --json)")
        doubtful = [
            r for r in part.records if not r.vouched and not (history and r.kind == "commit")
        ]
        for record in doubtful[:_SHOWN_RECORDS]:
            said = " ".join(
                bit
                for bit in (
                    record.kind,
                    record.ident,
                    f"by {record.by}" if record.by else "",
                    f"at {record.at_ms}" if record.at_ms is not None else "",
                )
                if bit
            )
            typer.echo(f"    #{record.index} {clean(said, 200)}: {record.note}")
        if len(doubtful) > _SHOWN_RECORDS:
            typer.echo(f"    ... and {len(doubtful) - _SHOWN_RECORDS} more (see --json)")


@app.command("export")
@ratchet_errors
def export_command(
    run_id: str,
    out: Annotated[
        Path | None, typer.Option("--out", help="File to write (default: RUN.ratchet-export here).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a run's signed checkpoint, archive, document, history, incidents and inbox as
    one file, sealed under the fleet's key ring, that `ratchet verify` checks offline.
    Records are exported exactly as the store holds them; it says which it vouches for."""
    path = out or Path(f"{run_id.replace('/', '_')}.ratchet-export")
    summary = write_export(Fleet.connect(), run_id, path)
    info = {**summary.as_dict(), "file": str(path)}
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"exported {run_id} ({summary.phase}, generation {summary.generation}) to {path}"
        )
        _echo_parts(summary, records=False)  # `ratchet verify FILE` lists the records


@app.command("verify")
@ratchet_errors
def verify_command(file: Path, as_json: JsonFlag = False) -> None:
    """Check an export file offline with the key ring (RATCHET_CHECKPOINT_KEY or
    RATCHET_CHECKPOINT_KEYS_FILE; no store is contacted): the file's seal, the document,
    the checkpoint and its archive as a restore checks them; then say, part by part, what
    it vouches for: each history entry, incident and inbox entry only by its own seal or
    signature (approvals and decisions with RATCHET_APPROVERS_FILE /
    RATCHET_REVIEWERS_FILE). Exits 2 if it does not verify, or a record's seal does not."""
    try:
        if file.stat().st_size > MAX_EXPORT_BYTES:
            raise ContractError("the file is larger than any export", field="file")
        blob = file.read_bytes()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read {file}: {exc.strerror or exc}", field="file"
        ) from None
    settings = Settings()
    summary = verify_export(
        load_keyring(settings),
        blob,
        approvers=load_trust_roots(settings.approvers_file, "approver"),
        reviewers=load_trust_roots(settings.reviewers_file, "reviewer"),
    )
    if as_json:
        print_json(summary.as_dict())
    else:
        typer.echo(
            f"{file}: verified: run {summary.run_id}, {summary.phase}, generation "
            f"{summary.generation}, {summary.executed} executed writes; the file is "
            "unchanged since it was exported"
        )
        _echo_parts(summary)


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
