"""Local commands: the in-process demo, scenario checks, key generation, version."""

from __future__ import annotations

import os
import re
import secrets
import sys
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Annotated

import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from rich.console import Console
from rich.table import Table

from ratchet.cli.common import (
    CHECKPOINT_KEY_ENV,
    EXIT_CHECK_FAILED,
    JsonFlag,
    app,
    fail,
    keys_app,
    print_json,
    ratchet_errors,
    scenario_app,
    write_private,
)
from ratchet.demo.local import DemoReport, run_demo
from ratchet.errors import ConfigurationError, ScenarioError
from ratchet.runtime import load_scenario

__all__ = ["local_demo"]

_SIGNER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# --- demo ------------------------------------------------------------------------------------


def _checkpoint_key_from_env() -> bytes | None:
    raw = os.environ.get(CHECKPOINT_KEY_ENV)
    if raw is None:
        return None
    try:
        key = bytes.fromhex(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{CHECKPOINT_KEY_ENV} must be hex") from None
    if len(key) < 32:
        raise ConfigurationError(f"{CHECKPOINT_KEY_ENV} must hold at least 32 bytes")
    return key


def _print_demo(report: DemoReport) -> None:
    console = Console(highlight=False)
    console.print(report.note, markup=False)
    table = Table(title=f"trace of {report.run_id}")
    table.add_column("seq", justify="right")
    table.add_column("outcome")
    table.add_column("idempotency key", overflow="fold")
    table.add_column("env version", justify="right")
    for event in report.trace:
        table.add_row(
            str(event["seq"]),
            event["outcome"],
            event["idempotency_key"] or "-",
            str(event["env_version"]),
        )
    console.print(table)
    summary = Table(title="summary", show_header=False)
    summary.add_column("what")
    summary.add_column("value")
    summary.add_row("injected crash", report.crash_window)
    summary.add_row("recovered by lease version", str(report.lease_version))
    summary.add_row("recovered window", report.recovered_window or "-")
    summary.add_row("reconcile outcome", report.reconcile_outcome)
    summary.add_row("stale owner's retry refused by the fence", str(report.stale_write_refused))
    summary.add_row("workspace write count", str(report.write_count))
    summary.add_row("phase / generation", f"{report.phase} / {report.generation}")
    for name, held in report.checks.items():
        summary.add_row(f"check: {name}", "ok" if held else "FAILED")
    console.print(summary)


@ratchet_errors
def local_demo(as_json: bool = False) -> None:
    """Run the example task through a crash and a recovery by a new owner.

    The first owner dies after the adapter wrote and before the receipt was committed; a
    new owner (lease version 2) reconciles: exactly one write, run completed. Runs in one
    process on in-memory stand-ins. Checkpoints are signed with the hex key in
    RATCHET_CHECKPOINT_KEY if set, else with a throwaway random key. Exits 1 if any of the
    demo's own checks fails.
    """
    report = run_demo(_checkpoint_key_from_env())
    if as_json:
        print_json(report.to_json())
    else:
        _print_demo(report)
    if not report.ok:
        failed = ", ".join(name for name, held in report.checks.items() if not held)
        typer.echo(f"ratchet: demo check failed: {failed}", err=True)
        raise typer.Exit(EXIT_CHECK_FAILED)


# --- scenario --------------------------------------------------------------------------------


class ScenarioFormat(StrEnum):
    JSON = "json"
    YAML = "yaml"


@scenario_app.command("check")
@ratchet_errors
def scenario_check(
    file: Annotated[Path, typer.Argument(help="Scenario file (JSON or YAML).")],
    fmt: Annotated[
        ScenarioFormat | None,
        typer.Option(
            "--format",
            help="File format; by default taken from the suffix (.yaml/.yml).",
            case_sensitive=False,
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Strict-load a scenario and print its fingerprint. Exit 2 naming the offending field."""
    if fmt is None:
        fmt = (
            ScenarioFormat.YAML if file.suffix.lower() in (".yaml", ".yml") else ScenarioFormat.JSON
        )
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        raise ScenarioError("scenario file is not UTF-8", field="scenario") from None
    scenario = load_scenario(text, fmt="yaml" if fmt is ScenarioFormat.YAML else "json")
    info = {
        "ok": True,
        "file": str(file),
        "format": fmt.value,
        "task_id": scenario.task_id,
        "task_version": scenario.task_version,
        "policy_id": scenario.policy_id,
        "policy_version": scenario.policy_version,
        "fingerprint": scenario.fingerprint,
    }
    if as_json:
        print_json(info)
        return
    console = Console(highlight=False)
    console.print(
        f"ok: {file} ({fmt.value}) task {scenario.task_id} v{scenario.task_version},"
        f" policy {scenario.policy_id} v{scenario.policy_version}",
        markup=False,
    )
    console.print(f"fingerprint {scenario.fingerprint}", markup=False)


# --- keys ------------------------------------------------------------------------------------


class SignerRole(StrEnum):
    APPROVER = "approver"
    REVIEWER = "reviewer"


@keys_app.command("gen-checkpoint-key")
def gen_checkpoint_key() -> None:
    """Print a fresh random 32-byte checkpoint HMAC key as hex on stdout."""
    typer.echo(secrets.token_bytes(32).hex())
    typer.echo(
        "keep this key outside checkpoints and the environment file of the run; "
        "supply it to workers as a secret",
        err=True,
    )


@keys_app.command("gen-signer")
@ratchet_errors
def gen_signer(
    role: Annotated[SignerRole, typer.Option("--role", help="approver or reviewer.")],
    signer_id: Annotated[str, typer.Option("--id", help="Signer id, e.g. alice.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the private key file.")],
    as_json: JsonFlag = False,
) -> None:
    """Write a new Ed25519 private key (PEM, mode 0600) and print its public key as hex.

    The private key is written to DIR/ROLE-ID.pem and never printed. Give the public key
    to the workers' trust roots for the role.
    """
    if not _SIGNER_ID.match(signer_id):
        raise ConfigurationError(
            "signer id must be 1..64 characters of [A-Za-z0-9._-] starting with a letter or digit",
            field="id",
        )
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"cannot create {out}: {exc.strerror or exc}") from None
    key = Ed25519PrivateKey.generate()
    path = out / f"{role.value}-{signer_id}.pem"
    write_private(path, key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    public_hex = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    if as_json:
        print_json(
            {
                "role": role.value,
                "id": signer_id,
                "private_key_path": str(path),
                "public_key_hex": public_hex,
            }
        )
        return
    typer.echo(public_hex)
    typer.echo(
        f"wrote the {role.value} private key for {signer_id} to {path} (mode 0600)", err=True
    )


# --- version ---------------------------------------------------------------------------------


def _version() -> str:
    try:
        return metadata.version("ratchet")
    except metadata.PackageNotFoundError:
        return "unknown"


@app.command()
def version(as_json: JsonFlag = False) -> None:
    """Print the installed ratchet version."""
    if as_json:
        print_json(
            {
                "name": "ratchet",
                "version": _version(),
                "python": ".".join(map(str, sys.version_info[:3])),
            }
        )
    else:
        typer.echo(f"ratchet {_version()}")
