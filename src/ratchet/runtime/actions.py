"""Actions an agent proposes: kinds, risk labels, exact argument sets, intent digests.

Every kind has exactly one required risk label and one exact argument set (the table
:data:`KIND_SPECS`, plain data). Writes must carry an idempotency key; everything else must
not. The intent digest covers kind, arguments and risk only: not the action id (a new
process may mint a new id for the same request) and not the key (so that "same key,
different intent" is detectable).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any

import orjson
from pydantic import Field, PlainValidator, Strict, ValidationError, model_validator

from ratchet.errors import ActionError
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.types import Frozen, Identifier, JsonValue, NonNegInt, check_rel_path

__all__ = [
    "KIND_SPECS",
    "Action",
    "ActionKind",
    "KindSpec",
    "Risk",
    "ToolName",
    "derive_idempotency_key",
    "intent_digest",
    "parse_action",
]


class Risk(StrEnum):
    READ_ONLY = "read_only"
    REVERSIBLE_WRITE = "reversible_write"
    IRREVERSIBLE_EXTERNAL_WRITE = "irreversible_external_write"
    VERIFICATION = "verification"
    CONTROL = "control"

    @property
    def is_write(self) -> bool:
        return self in (Risk.REVERSIBLE_WRITE, Risk.IRREVERSIBLE_EXTERNAL_WRITE)


class ActionKind(StrEnum):
    READ_FILE = "read_file"
    WRITE_FILE = "write_file"
    DELETE_FILE = "delete_file"
    EXTERNAL_CALL = "external_call"
    RUN_VERIFIER = "run_verifier"
    FINISH = "finish"


@dataclass(frozen=True, slots=True)
class KindSpec:
    """What a kind requires: its risk label, its exact argument names, which are paths."""

    risk: Risk
    args: frozenset[str]
    path_args: frozenset[str] = frozenset()
    target_arg: str | None = None


KIND_SPECS: dict[ActionKind, KindSpec] = {
    ActionKind.READ_FILE: KindSpec(Risk.READ_ONLY, frozenset({"path"}), frozenset({"path"})),
    ActionKind.WRITE_FILE: KindSpec(
        Risk.REVERSIBLE_WRITE, frozenset({"path", "content"}), frozenset({"path"})
    ),
    ActionKind.DELETE_FILE: KindSpec(
        Risk.REVERSIBLE_WRITE, frozenset({"path"}), frozenset({"path"})
    ),
    # An external call (HTTP API, order placement): the adapter names the operation and
    # the body is opaque text; it cannot be undone, so it is never replayed blindly.
    ActionKind.EXTERNAL_CALL: KindSpec(
        Risk.IRREVERSIBLE_EXTERNAL_WRITE, frozenset({"operation", "body"}), target_arg="operation"
    ),
    ActionKind.RUN_VERIFIER: KindSpec(
        Risk.VERIFICATION, frozenset({"target"}), target_arg="target"
    ),
    ActionKind.FINISH: KindSpec(Risk.CONTROL, frozenset({"summary"})),
}

_ArgText = Annotated[str, Strict(), Field(max_length=1 << 20)]

#: A declared tool's name (see :mod:`ratchet.runtime.catalog`); the built-in names parse
#: as :class:`ActionKind` first, so a tool can never pass for one.
ToolName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")]

_BUILTIN_KINDS = {kind.value: kind for kind in ActionKind}
_TOOL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def _parse_kind(value: object) -> ActionKind | str:
    """A built-in kind (as :class:`ActionKind`) or a declared tool's name (as ``str``): one
    dictionary lookup, no failed enum conversion for a tool's name."""
    if isinstance(value, ActionKind):
        return value
    if type(value) is not str:
        raise ValueError("kind must be a string")
    builtin = _BUILTIN_KINDS.get(value)
    if builtin is not None:
        return builtin
    if not _TOOL_NAME.match(value):
        raise ValueError(f"kind {value[:80]!r} is neither a built-in kind nor a tool name")
    return value


#: An action's kind: a built-in kind or a declared tool's name (never one for the other).
Kind = Annotated[
    ActionKind | ToolName,
    PlainValidator(_parse_kind, json_schema_input_type=ActionKind | ToolName),
]

#: The largest canonical JSON a tool call's arguments may take.
MAX_TOOL_ARGS_BYTES = 1 << 20


class Action(Frozen):
    """One proposed action.

    ``expected_env_version`` is the environment version the agent planned against (a
    precondition); ``deadline_at`` is the wall-clock second after which the proposal is
    stale; ``cost_units`` is what executing it spends from the cost budget.
    """

    action_id: Identifier
    kind: Kind
    risk: Risk
    # A built-in kind's arguments are text (checked below); a declared tool's are JSON,
    # checked against the tool's model when the proposal is gated (machine.propose).
    args: dict[Annotated[str, Strict()], JsonValue]
    idempotency_key: Identifier | None = None
    expected_env_version: NonNegInt
    deadline_at: NonNegInt
    cost_units: NonNegInt = 0

    @model_validator(mode="after")
    def _check_kind_contract(self) -> Action:
        if not isinstance(self.kind, ActionKind):
            return self._check_tool_contract()
        spec = KIND_SPECS[self.kind]
        for name, value in self.args.items():
            if not isinstance(value, str) or len(value) > 1 << 20:
                raise ValueError(f"kind {self.kind} argument {name!r} must be text up to 1 MiB")
        if self.risk is not spec.risk:
            raise ValueError(f"kind {self.kind} requires risk {spec.risk}, got {self.risk}")
        names = set(self.args)
        if names != spec.args:
            missing = sorted(spec.args - names)
            extra = sorted(names - spec.args)
            raise ValueError(
                f"kind {self.kind} takes exactly {sorted(spec.args)}; "
                f"missing {missing}, unexpected {extra}"
            )
        for name in spec.path_args:
            check_rel_path(self.text(name))
        if spec.risk.is_write and self.idempotency_key is None:
            raise ValueError(f"a {self.kind} write requires an idempotency_key")
        if not spec.risk.is_write and self.idempotency_key is not None:
            raise ValueError(f"{self.kind} is not a write and must not carry an idempotency_key")
        return self

    def _check_tool_contract(self) -> Action:
        """A declared tool's call: a tool's risk, and a key exactly when it writes (its
        arguments are checked against the tool's model later, where the tool is known)."""
        if self.risk in (Risk.CONTROL, Risk.VERIFICATION):
            raise ValueError(f"tool {self.kind} cannot have risk {self.risk}")
        # The size bound only (floats are refused by the type already): orjson's compact
        # form is canonical JSON's length but for key order.
        if len(orjson.dumps(self.args)) > MAX_TOOL_ARGS_BYTES:
            raise ValueError(f"tool {self.kind} arguments exceed {MAX_TOOL_ARGS_BYTES} bytes")
        if self.risk.is_write and self.idempotency_key is None:
            raise ValueError(f"a {self.kind} write requires an idempotency_key")
        if not self.risk.is_write and self.idempotency_key is not None:
            raise ValueError(f"{self.kind} is not a write and must not carry an idempotency_key")
        return self

    @property
    def is_write(self) -> bool:
        return self.risk.is_write

    @property
    def is_builtin(self) -> bool:
        """True for the built-in kinds, False for a declared tool's call."""
        return isinstance(self.kind, ActionKind)

    def text(self, name: str) -> str:
        """A built-in kind's text argument ``name`` (validated as text at parse time).

        Raises:
            ActionError: the action has no text argument of that name.
        """
        value = self.args.get(name)
        if not isinstance(value, str):
            raise ActionError(f"{self.kind} has no text argument {name!r}", field=f"args.{name}")
        return value

    @cached_property
    def intent_digest(self) -> str:
        """Computed once per (frozen) action; a copy computes its own (see model_copy)."""
        return intent_digest(self)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Action:
        """pydantic copies the instance dict, cached digest included; a copy with other
        arguments must not inherit it, so every copy computes its own."""
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("intent_digest", None)
        return copied


def intent_digest(action: Action) -> str:
    """Digest of what the action does: kind, arguments and risk, under the intent domain."""
    return digest(
        Domain.INTENT,
        {"kind": str(action.kind), "args": action.args, "risk": action.risk.value},
    )


def parse_action(data: Any) -> Action:
    """Validate an action from JSON-like data (what an agent returns).

    Raises:
        ActionError: naming the first offending field.
    """
    try:
        return Action.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "action"
        raise ActionError(f"invalid action at {field}: {first['msg']}", field=field) from None


def derive_idempotency_key(run_id: str, position: int, salt: str = "") -> str:
    """A deterministic idempotency key for the write at ``position`` of ``run_id``.

    Fixed before any side effect and identical on every retry, so a crashed run that
    proposes the same step again reuses the key. ``salt`` distinguishes a replanned step
    whose previous key was quarantined by a reviewer.
    """
    raw = f"{run_id}\x00{position}\x00{salt}".encode()
    return "ik-" + hashlib.sha256(b"ratchet/idempotency-key/v1\x00" + raw).hexdigest()[:40]
