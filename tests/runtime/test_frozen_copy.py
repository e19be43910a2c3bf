"""A frozen model's copy (``Frozen.model_copy``) is pydantic's shallow copy: the same
value, fields given, immutability and cached values as pydantic's own would give."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from ratchet.runtime.actions import Action
from ratchet.runtime.ports import Observation

FP = "a" * 64


def _observation() -> Observation:
    return Observation(instance_id="ws-1", version=1, fingerprint=FP, details={"k": "v"})


def test_a_copy_with_an_update_is_what_pydantic_would_make_and_leaves_the_original() -> None:
    original = _observation()
    ours = original.model_copy(update={"version": 2})
    theirs = BaseModel.model_copy(original, update={"version": 2})
    assert ours == theirs
    assert ours.model_fields_set == theirs.model_fields_set
    assert ours.__dict__ == theirs.__dict__
    assert original.version == 1
    assert ours.__dict__ is not original.__dict__
    with pytest.raises(ValidationError):
        ours.version = 3  # type: ignore[misc]  # still frozen


def test_a_deep_copy_is_pydantics_own() -> None:
    original = _observation()
    deep = original.model_copy(deep=True)
    assert deep == original
    assert deep.details is not original.details


def test_a_copied_action_with_other_arguments_computes_its_own_intent_digest() -> None:
    action = Action.model_validate(
        {
            "action_id": "a-1",
            "kind": "tk_create",
            "risk": "irreversible_external_write",
            "args": {"title": "x"},
            "idempotency_key": "k-1",
            "expected_env_version": 1,
            "deadline_at": 10,
        }
    )
    digest = action.intent_digest
    assert action.model_copy().intent_digest == digest
    other = action.model_copy(update={"args": {"title": "y"}})
    assert other.intent_digest != digest
