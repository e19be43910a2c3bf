"""Shared pieces of the command line: the Typer apps, error handling, JSON output.

The ``ratchet`` command line: wiring only.

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
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from pydantic import ValidationError

from ratchet.errors import ConfigurationError, ContractError, IntegrityError, RatchetError

__all__ = [
    "CHECKPOINT_KEY_ENV",
    "EXIT_CHECK_FAILED",
    "EXIT_ERROR",
    "JsonFlag",
    "app",
    "fail",
    "keys_app",
    "print_json",
    "ratchet_errors",
    "scenario_app",
    "store_app",
    "write_private",
]

CHECKPOINT_KEY_ENV = "RATCHET_CHECKPOINT_KEY"
EXIT_CHECK_FAILED = 1
EXIT_ERROR = 2
_SIGNER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: The errors that may name the field they refused (shown beside the message).
_NAMES_A_FIELD = (ConfigurationError, ContractError, IntegrityError)

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
keys_app = typer.Typer(
    help="Checkpoint keys and approver / reviewer signing keys.", no_args_is_help=True
)
app.add_typer(scenario_app, name="scenario")
app.add_typer(keys_app, name="keys")
store_app = typer.Typer(help="The store (Redis) itself: its epoch.", no_args_is_help=True)
app.add_typer(store_app, name="store")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str, field: str | None = None) -> NoReturn:
    """One line on stderr, exit code 2."""
    suffix = f" (field: {field})" if field else ""
    line = " ".join(f"{message}{suffix}".split())
    typer.echo(f"ratchet: error: {line}", err=True)
    raise typer.Exit(EXIT_ERROR)


def settings_error(exc: ValidationError) -> ConfigurationError:
    """A bad setting as one line naming its variable and what is wrong, never its value
    (a setting may be a secret: pydantic's own message quotes the input)."""
    first = exc.errors(include_input=False, include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    variable = f"RATCHET_{loc[0].upper()}" if loc else "RATCHET_*"
    # Inside a structured setting (RATCHET_CREDENTIALS' JSON): the path within it.
    inside = f" at {'.'.join(loc[1:])}" if len(loc) > 1 else ""
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ConfigurationError(
        f"bad setting {variable}{inside}: {first['msg']}{more}", field=variable
    )


def ratchet_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a RatchetError, or a bad setting, into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            try:
                return fn(*args, **kwargs)
            except ValidationError as exc:
                if exc.title != "Settings":
                    raise  # any other model's refusal is a bug to see whole
                raise settings_error(exc) from None
        except RatchetError as exc:
            field = exc.field if isinstance(exc, _NAMES_A_FIELD) else None
            fail(exc.message, field or None)

    return wrapper


def print_json(data: dict[str, Any]) -> None:
    typer.echo(json.dumps(data, sort_keys=True))


def write_private(path: Path, data: bytes) -> None:
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
