"""Tool contracts: what a tool is, as the pure core sees it (no implementation here).

A tool is an action kind with a declared contract: a name, a risk label, a pydantic model
of its arguments (whose JSON Schema is what a model is shown), whether it needs approval,
whether it checks fences itself, and how an interrupted call is recovered
(:class:`Recovery`). The built-in kinds (``read_file``, ``write_file``, ``delete_file``,
``external_call``, ``run_verifier``, ``finish``) are tools of the same shape
(:data:`BUILTIN_TOOLS`), implemented by the environment adapters.

The core needs only the contract: :func:`ratchet.runtime.machine.propose` validates a
proposed tool call's arguments against its model and its risk against the declared one
(``rejected_schema`` otherwise) before anything is committed, and
:meth:`ToolCatalog.check_scenario` refuses a scenario that permits a tool the worker does
not have, or that leaves out the approval a tool requires. The implementations (the
decorator, the class form, the ledger that makes a stateless tool an environment, MCP
servers) live in :mod:`ratchet.tools`.

Recovery (what happens to a call whose outcome a crash hid; docs/tools.md has the table):

* ``lookup``: the tool can find an earlier outcome by idempotency key; recovery asks it;
* ``idempotent``: the service dedupes by key (an ``Idempotency-Key`` header); recovery
  calls it again with the same key;
* ``review``: neither; recovery freezes the run in ``needs_review`` with the pending
  intent as evidence and never calls the tool again on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ratchet.errors import ActionError, ConfigurationError
from ratchet.runtime.actions import KIND_SPECS, ActionKind, Risk
from ratchet.runtime.canonical import Domain, canonical_json, digest
from ratchet.runtime.types import JsonValue, RelPath, StrictStr, Text

__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_NAME_PATTERN",
    "Recovery",
    "ToolCatalog",
    "ToolSpec",
]

#: A tool's name: what a scenario permits and what a model calls (OpenAI's function-name
#: rule, so every tool can be offered to a chat model unchanged).
TOOL_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"

_BUILTIN_NAMES = frozenset(kind.value for kind in ActionKind)


class Recovery(StrEnum):
    """How a call interrupted between its intent commit and its receipt is settled."""

    LOOKUP = "lookup"
    IDEMPOTENT = "idempotent"
    REVIEW = "review"


def _schema_has_number(schema: Any) -> bool:
    """True when a JSON Schema admits a JSON number that is not an integer anywhere."""
    if isinstance(schema, Mapping):
        kinds = schema.get("type")
        if kinds == "number" or (isinstance(kinds, list) and "number" in kinds):
            return True
        return any(_schema_has_number(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_schema_has_number(v) for v in schema)
    return False


@dataclass(frozen=True)
class ToolSpec:
    """One tool's contract. Build it through :mod:`ratchet.tools` (the decorator or the
    class form), or directly for a tool implemented by an adapter.

    Raises (constructor):
        ConfigurationError: a bad name, a risk a tool cannot have (``control``,
            ``verification`` are the built-ins' own), a recovery on a read, or an argument
            model that admits floats (canonical JSON has none: use ``int``, such as cents,
            or a string; a ``Decimal`` field admits JSON numbers too).
    """

    name: str
    risk: Risk
    args_model: type[BaseModel]
    description: str = ""
    requires_approval: bool = False
    recovery: Recovery = Recovery.REVIEW
    checks_fences: bool = False
    builtin: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not re.match(TOOL_NAME_PATTERN, self.name):
            raise ConfigurationError(
                f"tool name {self.name!r} must match {TOOL_NAME_PATTERN}", field="name"
            )
        if not self.builtin:
            if self.name in _BUILTIN_NAMES:
                raise ConfigurationError(
                    f"tool name {self.name!r} is a built-in kind", field="name"
                )
            if self.risk not in (
                Risk.READ_ONLY,
                Risk.REVERSIBLE_WRITE,
                Risk.IRREVERSIBLE_EXTERNAL_WRITE,
            ):
                raise ConfigurationError(
                    f"tool {self.name!r}: a tool is read_only, reversible_write or "
                    f"irreversible_external_write, not {self.risk.value}",
                    field="risk",
                )
            if self.requires_approval and not self.risk.is_write:
                raise ConfigurationError(
                    f"tool {self.name!r}: approvals gate writes only", field="requires_approval"
                )
            if _schema_has_number(self.json_schema):
                raise ConfigurationError(
                    f"tool {self.name!r}: its arguments admit floats, which canonical JSON "
                    "refuses (use int, such as cents, or a string)",
                    field="args",
                )

    @property
    def is_write(self) -> bool:
        return self.risk.is_write

    @cached_property
    def json_schema(self) -> dict[str, Any]:
        """The arguments' JSON Schema, as a model is shown it."""
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        return schema

    @cached_property
    def contract(self) -> dict[str, Any]:
        """What a run depends on: everything but the description (see :meth:`digest`)."""
        return {
            "name": self.name,
            "risk": self.risk.value,
            "requires_approval": self.requires_approval,
            "recovery": self.recovery.value if self.is_write else "",
            "checks_fences": self.checks_fences,
            # JSON round trip: the schema as canonical JSON sees it (no floats in it).
            "args": json.loads(json.dumps(self.json_schema)),
        }

    @cached_property
    def digest(self) -> str:
        return digest(Domain.TOOL, self.contract)

    @cached_property
    def plain_args(self) -> bool:
        """True when every argument is a plain ``str``, ``int`` or ``bool``: their values
        as JSON and in Python are the same, so a call is validated without the JSON round
        trip and handed to the tool as it was validated."""
        fields = self.args_model.model_fields
        return bool(fields) and all(f.annotation in (str, int, bool) for f in fields.values())

    def validate_args(self, args: Mapping[str, Any]) -> dict[str, JsonValue]:
        """``args`` checked against the model (strictly, as JSON) and normalised to what
        the model dumps (defaults filled in): the arguments the intent digest covers.

        Raises:
            ActionError: naming the first offending argument (``field="args.<name>"``).
        """
        try:
            parsed = (
                self.args_model.model_validate(dict(args), strict=True)
                if self.plain_args
                else self.args_model.model_validate_json(canonical_json(dict(args)), strict=True)
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            name = f"args.{where}" if where else "args"
            raise ActionError(
                f"tool {self.name} arguments invalid at {name}: {first['msg']}", field=name
            ) from None
        except Exception as exc:  # ContractError: floats or non-string keys in the input
            raise ActionError(
                f"tool {self.name} arguments are not canonical JSON: {exc}", field="args"
            ) from None
        dumped: dict[str, JsonValue] = parsed.model_dump(mode="json", by_alias=True)
        unexpected = sorted(set(args) - set(dumped))
        if unexpected:
            # A model that ignores unknown fields would drop them silently: the call the
            # agent proposed is not the one that would run. Refuse it instead.
            raise ActionError(
                f"tool {self.name} takes no argument {unexpected[0]!r}",
                field=f"args.{unexpected[0]}",
            )
        return dumped


def _args_model(name: str, **fields: Any) -> type[BaseModel]:
    model: type[BaseModel] = create_model(
        name, __config__=ConfigDict(extra="forbid", strict=True), **fields
    )
    return model


def _builtin(kind: ActionKind, description: str, **fields: Any) -> ToolSpec:
    spec = KIND_SPECS[kind]
    return ToolSpec(
        name=kind.value,
        risk=spec.risk,
        args_model=_args_model(f"{kind.value}_args", **fields),
        description=description,
        recovery=Recovery.LOOKUP,
        checks_fences=True,
        builtin=True,
    )


#: The built-in kinds as tools (implemented by the workspace, HTTP and verifier adapters).
BUILTIN_TOOLS: Mapping[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        _builtin(
            ActionKind.READ_FILE,
            "Read a file of the workspace.",
            path=(RelPath, Field(description="workspace-relative path")),
        ),
        _builtin(
            ActionKind.WRITE_FILE,
            "Write a whole file of the workspace (created or replaced).",
            path=(RelPath, Field(description="workspace-relative path")),
            content=(Text, Field(description="the file's new content")),
        ),
        _builtin(
            ActionKind.DELETE_FILE,
            "Delete a file of the workspace.",
            path=(RelPath, Field(description="workspace-relative path")),
        ),
        _builtin(
            ActionKind.EXTERNAL_CALL,
            "Call an allow-listed operation of the environment's HTTP API.",
            operation=(StrictStr, Field(description="the operation's name")),
            body=(Text, Field(description="the request body")),
        ),
        _builtin(
            ActionKind.RUN_VERIFIER,
            "Run an allow-listed verifier (the task's tests) against the workspace.",
            target=(StrictStr, Field(description="the verifier target")),
        ),
        _builtin(
            ActionKind.FINISH,
            "End the run with a summary.",
            summary=(Text, Field(description="what was done")),
        ),
    )
}


class ToolCatalog(Mapping[str, ToolSpec]):
    """The tools a worker has: the built-ins and the declared ones, by name.

    Raises (constructor):
        ConfigurationError: two tools with one name.
    """

    def __init__(self, tools: Iterable[ToolSpec] = ()) -> None:
        specs = dict(BUILTIN_TOOLS)
        for spec in tools:
            if spec.name in specs and specs[spec.name] is not spec:
                raise ConfigurationError(
                    f"two tools are named {spec.name!r}", field="tools", tool=spec.name
                )
            specs[spec.name] = spec
        self._specs = specs

    def __getitem__(self, name: str) -> ToolSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        declared = sorted(n for n, s in self._specs.items() if not s.builtin)
        return f"ToolCatalog(declared={declared})"

    def check_scenario(self, scenario: Any) -> None:
        """The scenario may be run with these tools: every permitted name is a tool here,
        every tool that requires approval is listed in ``approval_required``, and every
        name there is a write.

        Raises:
            ConfigurationError: naming the tool and the field.
        """
        for name in scenario.permissions:
            if str(name) not in self._specs:
                raise ConfigurationError(
                    f"the scenario permits {name!s}, which this worker has no tool for",
                    field="permissions",
                    tool=str(name),
                )
            spec = self._specs[str(name)]
            if spec.requires_approval and name not in scenario.approval_required:
                raise ConfigurationError(
                    f"tool {name!s} requires approval, which the scenario does not ask for "
                    "(list it in approval_required)",
                    field="approval_required",
                    tool=str(name),
                )
        for name in scenario.approval_required:
            found = self._specs.get(str(name))
            if found is not None and not found.is_write:
                raise ConfigurationError(
                    f"approval_required names {name!s}, which is not a write",
                    field="approval_required",
                    tool=str(name),
                )

    def permitted(self, scenario: Any) -> list[ToolSpec]:
        """The tools ``scenario`` permits, in its order (unknown names skipped)."""
        return [self._specs[str(n)] for n in scenario.permissions if str(n) in self._specs]

    def digest_for(self, names: Iterable[str]) -> str:
        """A digest over the contracts of the named tools (what a run's environment binds:
        a changed contract is a changed environment)."""
        return digest(
            Domain.TOOL,
            {n: self._specs[n].contract for n in sorted(set(names)) if n in self._specs},
        )
