"""Actions: exact argument sets, required risk labels, key rules, intent digests."""

from __future__ import annotations

from typing import Any

import pytest

from ratchet.errors import ActionError
from ratchet.runtime import KIND_SPECS, ActionKind, derive_idempotency_key, parse_action


def raw(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "action_id": "a-1",
        "kind": "write_file",
        "risk": "reversible_write",
        "args": {"path": "app.py", "content": "x"},
        "idempotency_key": "k-1",
        "expected_env_version": 1,
        "deadline_at": 100,
    }
    data.update(overrides)
    return data


def test_every_kind_has_one_risk_label_and_an_exact_argument_set() -> None:
    assert set(KIND_SPECS) == set(ActionKind)
    for spec in KIND_SPECS.values():
        assert spec.args


def test_a_kind_with_the_wrong_risk_label_is_refused() -> None:
    with pytest.raises(ActionError, match="requires risk"):
        parse_action(raw(risk="read_only"))


@pytest.mark.parametrize(
    "args", [{"path": "app.py"}, {"path": "app.py", "content": "x", "mode": "0644"}]
)
def test_missing_or_extra_arguments_are_refused(args: dict[str, str]) -> None:
    with pytest.raises(ActionError, match="takes exactly"):
        parse_action(raw(args=args))


def test_a_write_without_an_idempotency_key_is_refused() -> None:
    with pytest.raises(ActionError, match="requires an idempotency_key"):
        parse_action(raw(idempotency_key=None))


def test_a_read_with_an_idempotency_key_is_refused() -> None:
    with pytest.raises(ActionError, match="must not carry"):
        parse_action(raw(kind="read_file", risk="read_only", args={"path": "app.py"}))


def test_a_traversing_path_argument_is_refused() -> None:
    with pytest.raises(ActionError):
        parse_action(raw(args={"path": "../app.py", "content": "x"}))


def test_unknown_fields_and_boolean_versions_are_refused() -> None:
    with pytest.raises(ActionError):
        parse_action(raw(note="hi"))
    with pytest.raises(ActionError):
        parse_action(raw(expected_env_version=True))


def test_the_intent_digest_ignores_action_id_and_key_but_not_arguments() -> None:
    base = parse_action(raw()).intent_digest
    assert parse_action(raw(action_id="a-99", idempotency_key="k-2")).intent_digest == base
    assert parse_action(raw(args={"path": "app.py", "content": "y"})).intent_digest != base


def test_derived_keys_are_fixed_by_run_and_position() -> None:
    assert derive_idempotency_key("r", 3) == derive_idempotency_key("r", 3)
    assert derive_idempotency_key("r", 3) != derive_idempotency_key("r", 4)
    assert derive_idempotency_key("r", 3) != derive_idempotency_key("r", 3, salt="replan-1")
    parse_action(raw(idempotency_key=derive_idempotency_key("r", 3)))


def test_a_copy_with_other_arguments_never_inherits_the_cached_intent_digest() -> None:
    action = parse_action(
        {
            "action_id": "a-1",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": "app.py", "content": "one"},
            "idempotency_key": "k-1",
            "expected_env_version": 0,
            "deadline_at": 10,
        }
    )
    first = action.intent_digest  # cached on the instance from now on
    changed = action.model_copy(update={"args": {"path": "app.py", "content": "two"}})
    assert changed.intent_digest != first
    assert (
        changed.intent_digest
        == parse_action({**action.model_dump(mode="json"), "args": changed.args}).intent_digest
    )
    same = action.model_copy(update={"expected_env_version": 3})  # not part of the intent
    assert same.intent_digest == first


def test_a_changed_receipt_copy_never_inherits_the_cached_fingerprint() -> None:
    from ratchet.runtime import Receipt

    receipt = Receipt(
        namespace="ws",
        receipt_version=1,
        receipt_id="r-1",
        idempotency_key="k-1",
        intent_digest="0" * 64,
        result={"n": 1},
        committed_at=5,
        env_version_after=2,
    )
    first = receipt.fingerprint
    changed = receipt.model_copy(update={"result": {"n": 2}})
    assert changed.fingerprint != first
    assert changed.fingerprint == Receipt.model_validate(changed.model_dump()).fingerprint
