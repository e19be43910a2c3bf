"""Shared strict field types and the frozen model base for everything persisted or signed."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Annotated, Any, Self, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict
from typing_extensions import TypeAliasType

__all__ = [
    "IDENTIFIER_PATTERN",
    "Digest",
    "Frozen",
    "Identifier",
    "JsonObject",
    "JsonValue",
    "NonNegInt",
    "PosInt",
    "RelPath",
    "SignatureHex",
    "StrictBool",
    "StrictStr",
    "Text",
    "check_rel_path",
    "exact_version",
]


class Frozen(BaseModel):
    """Base for persisted, signed or cross-process models: immutable, no unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's shallow copy, in one step: the instance dict and the set of fields
        given copied, ``update`` applied to both without validation (as pydantic does).
        A frozen model forbids extra fields and declares no private attributes, so there
        is nothing else to copy; a deep copy, or an instance that has either, goes to
        pydantic's own. The engine copies a state about ten times per step."""
        if (
            deep
            or self.__pydantic_extra__ is not None
            or getattr(self, "__pydantic_private__", None) is not None
        ):
            return super().model_copy(update=update, deep=deep)
        copied = self.__class__.__new__(self.__class__)
        values = self.__dict__.copy()
        given = self.__pydantic_fields_set__.copy()
        if update:
            values.update(update)
            given.update(update.keys())
        _set_attribute(copied, "__dict__", values)
        _set_attribute(copied, "__pydantic_extra__", None)
        _set_attribute(copied, "__pydantic_fields_set__", given)
        _set_attribute(copied, "__pydantic_private__", None)
        return copied


_set_attribute = object.__setattr__  # what pydantic's own copy uses on a frozen model


StrictStr = Annotated[str, Strict()]
StrictBool = Annotated[bool, Strict()]
NonNegInt = Annotated[int, Strict(), Field(ge=0, le=2**63 - 1)]
PosInt = Annotated[int, Strict(), Field(ge=1, le=2**63 - 1)]
#: What an identifier (a run id, an idempotency key...) may hold: 1 to 200 of these.
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/+-]*$"
Identifier = Annotated[
    str, Strict(), Field(min_length=1, max_length=200, pattern=IDENTIFIER_PATTERN)
]
Digest = Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{64}$")]
SignatureHex = Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{128}$")]
Text = Annotated[str, Strict(), Field(max_length=1 << 20)]

_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")


def check_rel_path(value: str) -> str:
    """Accept only canonical, relative, non-traversing POSIX paths.

    Refused: empty, absolute, backslashes, ``.``/``..`` segments, empty segments (``a//b``,
    trailing ``/``), characters outside ``[A-Za-z0-9._-]`` per segment, and text that is
    not in Unicode NFC form.
    """
    if not value or len(value) > 1024:
        raise ValueError("path must be 1..1024 characters")
    if unicodedata.normalize("NFC", value) != value:
        raise ValueError("path is not in canonical (NFC) form")
    if value.startswith("/") or "\\" in value:
        raise ValueError("path must be relative and use '/'")
    for segment in value.split("/"):
        if segment in ("", ".", ".."):
            raise ValueError("path has an empty, '.' or '..' segment")
        if not _SEGMENT.match(segment):
            raise ValueError(f"path segment {segment!r} has characters outside [A-Za-z0-9._-]")
    return value


RelPath = Annotated[str, Strict(), AfterValidator(check_rel_path)]


# JSON without floats, for state that agents keep (plan cursors, notes, summaries). Strict
# members: a bool stays a bool and never passes for an int.
JsonValue = TypeAliasType(
    "JsonValue",
    "Union[Annotated[str, Strict()], Annotated[int, Strict()], Annotated[bool, Strict()], "
    "None, list[JsonValue], dict[str, JsonValue]]",
)
JsonObject = dict[Annotated[str, Strict()], JsonValue]


def exact_version(value: object) -> object:
    """A schema version as a field validator (``mode="before"``) checks it: an integer,
    never ``True`` or ``1.0`` (a ``Literal[1]`` takes both for 1)."""
    if type(value) is not int:
        raise ValueError("schema_version must be the integer 1")
    return value
