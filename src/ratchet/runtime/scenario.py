"""The scenario: the externally fixed task contract a run executes under.

A scenario is loaded strictly from JSON or YAML (see :func:`load_scenario`) and never
from a checkpoint: restore takes it from outside and compares its fingerprint, so a
changed task version, policy version, permission, allowlist, initial state or verifier
expectation makes every older checkpoint fail closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from ratchet.errors import ContractError, ScenarioError
from ratchet.runtime.actions import KIND_SPECS, ActionKind, ToolName
from ratchet.runtime.canonical import (
    Domain,
    model_digest,
    strict_json_loads,
    strict_yaml_loads,
)
from ratchet.runtime.types import (
    Frozen,
    Identifier,
    NonNegInt,
    PosInt,
    RelPath,
    Text,
    exact_version,
)

__all__ = ["SCENARIO_SCHEMA_VERSION", "Budgets", "Scenario", "VerifierSpec", "load_scenario"]

SCENARIO_SCHEMA_VERSION = 1

_Permission = Annotated[ActionKind | ToolName, Field(union_mode="left_to_right")]


class Budgets(Frozen):
    """Limits for one run. A rejected proposal still spends a proposal."""

    proposals: PosInt
    steps: PosInt
    wall_clock_seconds: PosInt
    cost_units: NonNegInt


class VerifierSpec(Frozen):
    """What the verifier must see: the target to run and the files expected at the end."""

    target: Identifier
    expected_files: dict[RelPath, Text] = Field(default_factory=dict)


def _path_allowed(path: str, allowed: tuple[str, ...]) -> bool:
    """A path is allowed if it equals an allowed path or lies under an allowed folder."""
    p = PurePosixPath(path)
    return any(p == PurePosixPath(a) or PurePosixPath(a) in p.parents for a in allowed)


class Scenario(Frozen):
    """A task contract: who may do what, within which budget, from which initial state."""

    schema_version: Literal[1]
    task_id: Identifier
    task_version: Identifier
    policy_id: Identifier
    policy_version: Identifier
    # Built-in kinds and declared tools by name (a worker without a permitted tool
    # refuses the run: ToolCatalog.check_scenario).
    permissions: tuple[_Permission, ...]
    allowed_paths: tuple[RelPath, ...]
    allowed_verifier_targets: tuple[Identifier, ...]
    allowed_operations: tuple[Identifier, ...] = ()
    approval_required: tuple[_Permission, ...]
    budgets: Budgets
    initial_files: dict[RelPath, Text]
    verifier: VerifierSpec

    _exact_version = field_validator("schema_version", mode="before")(exact_version)

    @field_validator("approval_required")
    @classmethod
    def _approvable(
        cls, kinds: tuple[ActionKind | str, ...], info: ValidationInfo
    ) -> tuple[ActionKind | str, ...]:
        permitted = info.data.get("permissions", ())
        for kind in kinds:
            if kind not in permitted:
                raise ValueError(f"names {kind}, which is not permitted")
            # An approval authorises one effect: it binds the write's idempotency key and
            # intent, and the gate checks it only before a write goes to the adapter. A
            # read, a verifier run or a finish has neither, so listing one would promise a
            # check that never happens: refuse the contract instead.
            # A declared tool's risk is known where the tool is: the worker checks it
            # (ToolCatalog.check_scenario) before it runs the scenario.
            if isinstance(kind, ActionKind) and not KIND_SPECS[kind].risk.is_write:
                raise ValueError(f"names {kind}, which is not a write; approvals gate writes only")
        return kinds

    @model_validator(mode="after")
    def _cross_checks(self) -> Scenario:
        for name in (
            "permissions",
            "allowed_paths",
            "allowed_verifier_targets",
            "allowed_operations",
            "approval_required",
        ):
            items = getattr(self, name)
            if len(set(items)) != len(items):
                raise ValueError(f"{name} has duplicate entries")
        if self.budgets.steps > self.budgets.proposals:
            raise ValueError("budgets.steps exceeds budgets.proposals")
        for path in self.verifier.expected_files:
            if not _path_allowed(path, self.allowed_paths):
                raise ValueError(f"verifier.expected_files has {path!r} outside allowed_paths")
        if self.verifier.target not in self.allowed_verifier_targets:
            raise ValueError("verifier.target is not in allowed_verifier_targets")
        return self

    def path_allowed(self, path: str) -> bool:
        return _path_allowed(path, self.allowed_paths)

    def target_allowed(self, kind: ActionKind | str, target: str) -> bool:
        if kind is ActionKind.RUN_VERIFIER:
            return target in self.allowed_verifier_targets
        if kind is ActionKind.EXTERNAL_CALL:
            return target in self.allowed_operations
        return True

    def needs_approval(self, kind: ActionKind | str) -> bool:
        return kind in self.approval_required

    @cached_property
    def fingerprint(self) -> str:
        """Digest over the whole contract, including the schema version."""
        return model_digest(Domain.SCENARIO, self)


def _validation_to_error(exc: ValidationError) -> ScenarioError:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "scenario"
    return ScenarioError(f"scenario field {field}: {first['msg']}", field=field)


def load_scenario(text: str | bytes, *, fmt: Literal["json", "yaml"] = "json") -> Scenario:
    """Load a scenario strictly from JSON or YAML text.

    Raises:
        ScenarioError: naming the field, for unknown or missing fields, duplicate keys,
            NaN/Infinity/floats, booleans where integers belong, non-canonical or traversing
            paths, steps above proposals, duplicate list entries, expected files outside
            the allowed paths.
    """
    try:
        data: Any = strict_json_loads(text) if fmt == "json" else strict_yaml_loads(text)
    except Exception as exc:  # ContractError from the strict parsers
        field = (exc.field if isinstance(exc, ContractError) else None) or "scenario"
        raise ScenarioError(f"scenario is not strict {fmt}: {exc}", field=field) from None
    if not isinstance(data, dict):
        raise ScenarioError("scenario must be an object", field="scenario")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise _validation_to_error(exc) from None


def kind_spec_target(kind: ActionKind | str, args: Mapping[str, object]) -> str | None:
    """The allow-listed target a built-in action names (verifier target or operation), if
    any; a declared tool is allow-listed by its name alone."""
    if not isinstance(kind, ActionKind):
        return None
    arg = KIND_SPECS[kind].target_arg
    return str(args[arg]) if arg else None
