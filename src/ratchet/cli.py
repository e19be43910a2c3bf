"""The ``ratchet`` command line: wiring only.

Commands::

    ratchet demo [--json]                      the example task, with a crash and recovery
    ratchet scenario check FILE [--format F]   strict-load a task contract, print its fingerprint
    ratchet keys gen-checkpoint-key            a fresh 32-byte checkpoint HMAC key, as hex
    ratchet keys gen-signer --role R --id N --out DIR
                                               an Ed25519 approver or reviewer key pair
    ratchet version [--json]

Every command that prints a report takes ``--json`` and then prints exactly one JSON object
on stdout. A :class:`~ratchet.errors.RatchetError` becomes one line on stderr and exit code
2, never a traceback; its message never carries key material. A demo whose own checks fail
exits 1.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import sys
from collections.abc import Callable
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

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

from ratchet.errors import ConfigurationError, RatchetError, ScenarioError
from ratchet.runtime import load_scenario
from ratchet.worker.demo import DemoReport, run_demo

__all__ = ["CHECKPOINT_KEY_ENV", "app", "main"]

CHECKPOINT_KEY_ENV = "RATCHET_CHECKPOINT_KEY"
EXIT_CHECK_FAILED = 1
EXIT_ERROR = 2
_SIGNER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

app = typer.Typer(
    name="ratchet",
    help="Signed checkpoints, leases and fenced commits for long agent tasks.",
    no_args_is_help=True,
    add_completion=False,
    # Never render locals in a traceback: they may hold key material.
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)
scenario_app = typer.Typer(help="Task contracts (scenarios).", no_args_is_help=True)
keys_app = typer.Typer(help="Checkpoint keys and approver / reviewer signing keys.",
                       no_args_is_help=True)
app.add_typer(scenario_app, name="scenario")
app.add_typer(keys_app, name="keys")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]

P = ParamSpec("P")
R = TypeVar("R")


def _fail(message: str, field: str | None = None) -> NoReturn:
    """One line on stderr, exit code 2."""
    suffix = f" (field: {field})" if field else ""
    line = " ".join(f"{message}{suffix}".split())
    typer.echo(f"ratchet: error: {line}", err=True)
    raise typer.Exit(EXIT_ERROR)


def _ratchet_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a RatchetError into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RatchetError as exc:
            field = exc.context.get("field")
            _fail(exc.message, str(field) if field else None)

    return wrapper


def _print_json(data: dict[str, Any]) -> None:
    typer.echo(json.dumps(data, sort_keys=True))


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
        table.add_row(str(event["seq"]), event["outcome"], event["idempotency_key"] or "-",
                      str(event["env_version"]))
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


@app.command()
@_ratchet_errors
def demo(as_json: JsonFlag = False) -> None:
    """Run the example task through a crash and a recovery by a new owner.

    The first owner dies after the adapter wrote and before the receipt was committed; a
    new owner (lease version 2) reconciles: exactly one write, run completed. Runs in one
    process on in-memory stand-ins. Checkpoints are signed with the hex key in
    RATCHET_CHECKPOINT_KEY if set, else with a throwaway random key. Exits 1 if any of the
    demo's own checks fails.
    """
    report = run_demo(_checkpoint_key_from_env())
    if as_json:
        _print_json(report.to_json())
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
@_ratchet_errors
def scenario_check(
    file: Annotated[Path, typer.Argument(help="Scenario file (JSON or YAML).")],
    fmt: Annotated[ScenarioFormat | None, typer.Option(
        "--format", help="File format; by default taken from the suffix (.yaml/.yml).",
        case_sensitive=False)] = None,
    as_json: JsonFlag = False,
) -> None:
    """Strict-load a scenario and print its fingerprint. Exit 2 naming the offending field."""
    if fmt is None:
        fmt = (ScenarioFormat.YAML if file.suffix.lower() in (".yaml", ".yml")
               else ScenarioFormat.JSON)
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        _fail(f"cannot read {file}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        raise ScenarioError("scenario file is not UTF-8", field="scenario") from None
    scenario = load_scenario(text, fmt="yaml" if fmt is ScenarioFormat.YAML else "json")
    info = {"ok": True, "file": str(file), "format": fmt.value, "task_id": scenario.task_id,
            "task_version": scenario.task_version, "policy_id": scenario.policy_id,
            "policy_version": scenario.policy_version, "fingerprint": scenario.fingerprint}
    if as_json:
        _print_json(info)
        return
    console = Console(highlight=False)
    console.print(f"ok: {file} ({fmt.value}) task {scenario.task_id} v{scenario.task_version},"
                  f" policy {scenario.policy_id} v{scenario.policy_version}", markup=False)
    console.print(f"fingerprint {scenario.fingerprint}", markup=False)


# --- keys ------------------------------------------------------------------------------------


class SignerRole(StrEnum):
    APPROVER = "approver"
    REVIEWER = "reviewer"


@keys_app.command("gen-checkpoint-key")
def gen_checkpoint_key() -> None:
    """Print a fresh random 32-byte checkpoint HMAC key as hex on stdout."""
    typer.echo(secrets.token_bytes(32).hex())
    typer.echo("keep this key outside checkpoints and the environment file of the run; "
               "supply it to workers as a secret", err=True)


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600; refuse to replace an existing file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigurationError(f"{path} already exists; not overwriting a key") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


@keys_app.command("gen-signer")
@_ratchet_errors
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
        raise ConfigurationError("signer id must be 1..64 characters of [A-Za-z0-9._-] "
                                 "starting with a letter or digit", field="id")
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"cannot create {out}: {exc.strerror or exc}") from None
    key = Ed25519PrivateKey.generate()
    path = out / f"{role.value}-{signer_id}.pem"
    _write_private(path, key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    public_hex = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    if as_json:
        _print_json({"role": role.value, "id": signer_id, "private_key_path": str(path),
                     "public_key_hex": public_hex})
        return
    typer.echo(public_hex)
    typer.echo(f"wrote the {role.value} private key for {signer_id} to {path} (mode 0600)",
               err=True)


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
        _print_json({"name": "ratchet", "version": _version(),
                     "python": ".".join(map(str, sys.version_info[:3]))})
    else:
        typer.echo(f"ratchet {_version()}")


def main() -> None:
    """Console entry point (``ratchet``)."""
    app()
