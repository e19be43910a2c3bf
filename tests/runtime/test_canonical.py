"""Canonical JSON and digests: stable under reordering, strict on load, domain separated."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratchet.errors import ContractError
from ratchet.runtime.canonical import (
    Domain,
    canonical_json,
    digest,
    strict_json_loads,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def reorder(value: Any, rnd: st.DataObject) -> Any:
    if isinstance(value, dict):
        keys = rnd.draw(st.permutations(list(value)))
        return {k: reorder(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [reorder(v, rnd) for v in value]
    return value


@given(value=json_values, data=st.data())
def test_canonical_json_gives_the_same_digest_under_key_reordering(
    value: Any, data: st.DataObject
) -> None:
    shuffled = reorder(value, data)
    assert canonical_json(shuffled) == canonical_json(value)
    assert digest(Domain.INTENT, shuffled) == digest(Domain.INTENT, value)


@given(value=json_values)
def test_canonical_json_round_trips_through_the_strict_parser(value: Any) -> None:
    assert strict_json_loads(canonical_json(value)) == value


def test_canonical_json_is_compact_sorted_utf8() -> None:
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'.encode()


def test_floats_are_refused_in_canonical_json() -> None:
    with pytest.raises(ContractError):
        canonical_json({"x": [1, 0.5]})


def test_digests_are_domain_separated() -> None:
    value = {"k": "v"}
    plain = hashlib.sha256(canonical_json(value)).hexdigest()
    assert digest(Domain.INTENT, value) != plain
    assert digest(Domain.INTENT, value) != digest(Domain.RECEIPT, value)


@pytest.mark.parametrize(
    "text", ['{"a":1,"a":2}', '{"a":NaN}', '{"a":Infinity}', '{"a":1.0}', "{", "\xff"]
)
def test_the_strict_parser_refuses_what_canonical_json_never_makes(text: str) -> None:
    with pytest.raises(ContractError):
        strict_json_loads(text)


def test_no_persisted_model_declares_a_float_field() -> None:
    """model_json skips the float walk on the strength of this."""
    import json as _json

    from ratchet.runtime import (
        ApprovalEvidence,
        Receipt,
        ReviewDecision,
        RunState,
        Scenario,
    )
    from ratchet.runtime.checkpoint import CheckpointPayload

    for model in (CheckpointPayload, RunState, Scenario, Receipt, ApprovalEvidence, ReviewDecision):
        schema = _json.dumps(model.model_json_schema())
        assert '"type": "number"' not in schema, model.__name__
