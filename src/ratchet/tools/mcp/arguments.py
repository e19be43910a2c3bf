"""An MCP tool's input schema as a ratchet argument model: its JSON Schema is exactly the
server's, and input is validated by it (``jsonschema``) and kept as given."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

import orjson
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
    # The canonical JSON of arguments this schema accepted lately (see _by_schema).
    accepted: ClassVar[dict[bytes, None]] = {}

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return copy.deepcopy(cls.input_schema)

    @model_validator(mode="before")
    @classmethod
    def _by_schema(cls, data: Any) -> Any:
        if cls.schema_validator is None:
            raise ValueError("arguments have no schema to be checked by")
        # A call's arguments are checked when it is proposed and again when the tool is
        # called with them: whether a schema accepts a value depends on nothing else (no
        # format checker, an empty registry), so an exact JSON value accepted lately is
        # not walked again. Only values of exactly the JSON types are remembered, by
        # their canonical bytes (a tuple, which the schema sees as no array, never is).
        key = _exact_json_key(data)
        if key is not None and key in cls.accepted:
            return data
        error = best_match(cls.schema_validator.iter_errors(data))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise ValueError(f"at {where}: {error.message}")
        if cls.extra_check is not None and isinstance(data, Mapping):
            refused = cls.extra_check(data)
            if refused is not None:
                raise ValueError(refused)
        if key is not None:
            accepted = cls.accepted
            with contextlib.suppress(RuntimeError, StopIteration, KeyError):
                while len(accepted) >= _ACCEPTED_KEPT:  # another thread may evict meanwhile
                    accepted.pop(next(iter(accepted)))
            accepted[key] = None
        return data


_ACCEPTED_KEPT = 64
_JSON_SCALARS = frozenset({str, int, bool, type(None)})
_JSON_KEY_BYTES = 1 << 16  # larger arguments are checked every time (not remembered)


def _exact_json_key(value: Any) -> bytes | None:
    """The canonical JSON of ``value`` when it is built of exactly ``dict`` (``str``
    keys), ``list``, ``str``, ``int``, ``bool`` and ``None`` and is small; else None."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict:
            for key, item in node.items():
                if type(key) is not str:
                    return None
                if type(item) not in _JSON_SCALARS:
                    stack.append(item)
        elif kind is list:
            stack.extend(item for item in node if type(item) not in _JSON_SCALARS)
        elif kind not in _JSON_SCALARS:
            return None
    try:
        encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # an integer past 64 bits
        return None
    return encoded if len(encoded) <= _JSON_KEY_BYTES else None


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
        "accepted": {},
    }
    return cast(type[SchemaArgs], type(f"{tool}_args", (SchemaArgs,), namespace))
