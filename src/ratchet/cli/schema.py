"""``ratchet schema``: the JSON Schemas of the files ratchet reads, generated from the
models that read them, so a schema and its reader cannot drift apart."""

from __future__ import annotations

import json
from typing import Any

import typer

from ratchet.cli.common import app, ratchet_errors
from ratchet.ops.taskfile import plan_file_schema, task_file_schema

__all__: list[str] = []

schema_app = typer.Typer(help="JSON Schemas of the files ratchet reads.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")


def _print(schema: dict[str, Any]) -> None:
    typer.echo(json.dumps(schema, indent=2, sort_keys=True))


@schema_app.command("task")
@ratchet_errors
def schema_task() -> None:
    """Print the JSON Schema of a task file (ratchet submit TASK_FILE); the reference is
    docs/task-file.md."""
    _print(task_file_schema())


@schema_app.command("plan")
@ratchet_errors
def schema_plan() -> None:
    """Print the JSON Schema of a plan file (ratchet submit TASK_FILE --agent PLAN_FILE)."""
    _print(plan_file_schema())
