"""What an MCP tool's schema remembers: arguments it accepted lately are not walked
again, and nothing else is ever taken for them (another value, another type, another
tool's schema)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from ratchet.tools.mcp.arguments import SchemaArgs, schema_model

TICKET = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "count": {"type": "integer"},
    },
    "required": ["title"],
    "additionalProperties": False,
}


class _Recording:
    """A schema validator that records every value it walks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.walked: list[Any] = []

    def iter_errors(self, instance: Any) -> Any:
        self.walked.append(instance)
        return self.inner.iter_errors(instance)


def _walks(model: type[SchemaArgs]) -> list[Any]:
    recording = _Recording(model.schema_validator)
    model.schema_validator = recording
    return recording.walked


def test_arguments_accepted_once_are_not_walked_again_and_a_changed_value_still_is() -> None:
    model = schema_model("tk_create", TICKET)
    walked = _walks(model)
    given = {"title": "printer on fire", "tags": ["floor-3"], "count": 2}
    model.model_validate(dict(given))
    model.model_validate(dict(given))
    assert len(walked) == 1
    for bad in (
        {"title": "", "tags": ["floor-3"], "count": 2},
        {"title": "printer on fire", "tags": ["floor-3"], "count": True},
        {"title": "printer on fire", "tags": [3], "count": 2},
        {"title": "printer on fire", "tags": ["floor-3"], "count": 2, "extra": 1},
    ):
        with pytest.raises(ValidationError):
            model.model_validate(bad)


def test_a_tuple_is_never_taken_for_the_list_the_schema_accepted() -> None:
    model = schema_model("tk_create", TICKET)
    model.model_validate({"title": "x", "tags": ["a"]})
    # The same JSON text, but not an array to the schema: walked, and refused.
    with pytest.raises(ValidationError):
        model.model_validate({"title": "x", "tags": ("a",)})


def test_two_tools_do_not_share_what_their_schemas_accepted() -> None:
    loose = schema_model("tk_loose", {"type": "object"})
    strict = schema_model("tk_strict", TICKET)
    loose.model_validate({"title": "x", "other": 1})
    with pytest.raises(ValidationError):
        strict.model_validate({"title": "x", "other": 1})
    assert loose.accepted is not strict.accepted


def test_what_a_schema_remembers_is_bounded() -> None:
    model = schema_model("tk_create", TICKET)
    for n in range(500):
        model.model_validate({"title": f"ticket {n}"})
    assert 0 < len(model.accepted) <= 64
