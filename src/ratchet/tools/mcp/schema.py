"""An MCP tool's input schema as a ratchet argument model: its JSON Schema is exactly the
server's, and input is validated by it (``jsonschema``) and kept as given."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

from jsonschema.exceptions import SchemaError, best_match  # type: ignore[import-untyped]
from jsonschema.validators import validator_for  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, model_validator
from referencing import Registry

from ratchet.errors import (
    ConfigurationError,
)


class SchemaArgs(BaseModel):
    """Arguments checked by a server's JSON Schema (with ``jsonschema``) and kept exactly
    as given. Each tool gets a subclass whose ``model_json_schema()`` is that schema."""

    model_config = ConfigDict(extra="allow", frozen=True)

    input_schema: ClassVar[dict[str, Any]] = {"type": "object"}
    schema_validator: ClassVar[Any] = None
    #: A check beyond the schema (the operator's, e.g. a key recipe's placeholder): why
    #: the arguments are refused, or None. It shows nowhere in the schema.
    extra_check: ClassVar[Callable[[Mapping[str, Any]], str | None] | None] = None

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return copy.deepcopy(cls.input_schema)

    @model_validator(mode="before")
    @classmethod
    def _by_schema(cls, data: Any) -> Any:
        if cls.schema_validator is None:
            raise ValueError("arguments have no schema to be checked by")
        error = best_match(cls.schema_validator.iter_errors(data))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise ValueError(f"at {where}: {error.message}")
        if cls.extra_check is not None and isinstance(data, Mapping):
            refused = cls.extra_check(data)
            if refused is not None:
                raise ValueError(refused)
        return data


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, Mapping):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return False


def _admits_number(schema: Any) -> bool:
    if isinstance(schema, Mapping):
        kinds = schema.get("type")
        if kinds == "number" or (isinstance(kinds, list) and "number" in kinds):
            return True
        return any(_admits_number(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_admits_number(v) for v in schema)
    return False


def schema_model(
    tool: str,
    schema: Mapping[str, Any],
    *,
    check: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> type[SchemaArgs]:
    """The arguments model of ``tool`` (a ratchet name) from its MCP ``inputSchema``;
    ``check`` refuses what the schema admits but the operator does not (see
    :attr:`SchemaArgs.extra_check`).

    Raises:
        ConfigurationError: not an object schema, not a valid JSON Schema, or one that
            admits (or holds) non-integer numbers, which canonical JSON refuses.
    """
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ConfigurationError(
            f"MCP tool {tool!r}: its inputSchema is not an object schema", field="args"
        )
    if _admits_number(schema) or _has_float(schema):
        raise ConfigurationError(
            f"MCP tool {tool!r}: its inputSchema admits non-integer numbers, which canonical "
            "JSON refuses (leave it out with include=)",
            field="args",
        )
    kept = copy.deepcopy(dict(schema))
    checker = validator_for(kept)
    try:
        checker.check_schema(kept)
    except SchemaError as exc:
        raise ConfigurationError(
            f"MCP tool {tool!r}: its inputSchema is not valid JSON Schema ({exc.message})",
            field="args",
        ) from None
    # An empty registry: a $ref resolves inside the schema only, never over the network.
    namespace = {
        "__module__": __name__,
        "input_schema": kept,
        "schema_validator": checker(kept, registry=Registry()),
        "extra_check": staticmethod(check) if check is not None else None,
    }
    return cast(type[SchemaArgs], type(f"{tool}_args", (SchemaArgs,), namespace))
