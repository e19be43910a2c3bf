"""Seals on a run's records (incidents): a sealed record verifies only unchanged and only
for its own run; a record without a seal, or with one these keys cannot check, is never
taken for a sealed one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ratchet.runtime import KeyRing
from ratchet.runtime.canonical import Domain, strict_json_loads
from ratchet.runtime.seals import SealVerdict, check_record_seal, seal_record

RING = KeyRing.from_secrets({"k1": b"k" * 32, "k2": b"j" * 32}, signing_kid="k2", retired=["k1"])
OTHER = KeyRing.from_secrets({"k2": b"x" * 32}, signing_kid="k2")
RECORD = {"id": "inc-1", "kind": "operator_retry", "operator": "bob", "reason": "fixed"}


def stored(record: dict[str, Any]) -> dict[str, Any]:
    """As a reader gets it back from the store (JSON text and back)."""
    loaded: dict[str, Any] = json.loads(json.dumps(record, sort_keys=True))
    return loaded


def test_a_sealed_record_verifies_for_its_run_after_a_trip_through_the_store() -> None:
    sealed = seal_record(RING, "r-1", RECORD)
    assert sealed["seal"]["kid"] == "k2" and len(sealed["seal"]["mac"]) == 64
    assert {k: v for k, v in sealed.items() if k != "seal"} == RECORD
    assert check_record_seal(RING, "r-1", stored(sealed)).verdict is SealVerdict.SEALED


@pytest.mark.parametrize(
    "change",
    [
        {"operator": "alice"},
        {"kind": "job_error"},
        {"id": "inc-2"},
        {"extra": "field"},
    ],
)
def test_any_change_to_a_sealed_record_breaks_its_seal(change: dict[str, str]) -> None:
    sealed = {**seal_record(RING, "r-1", RECORD), **change}
    check = check_record_seal(RING, "r-1", sealed)
    assert check.verdict is SealVerdict.BROKEN and "does not verify" in check.reason


def test_a_field_removed_from_a_sealed_record_breaks_its_seal() -> None:
    sealed = seal_record(RING, "r-1", RECORD)
    del sealed["reason"]
    assert check_record_seal(RING, "r-1", sealed).verdict is SealVerdict.BROKEN


def test_a_record_sealed_for_another_run_does_not_verify_for_this_one() -> None:
    sealed = seal_record(RING, "r-1", RECORD)
    assert check_record_seal(RING, "r-2", sealed).verdict is SealVerdict.BROKEN


def test_a_record_sealed_under_another_domain_does_not_verify_as_an_incident() -> None:
    sealed = seal_record(RING, "r-1", RECORD, domain=Domain.CONTROL)
    assert check_record_seal(RING, "r-1", sealed).verdict is SealVerdict.BROKEN


def test_a_record_without_a_seal_is_unsigned_never_sealed() -> None:
    check = check_record_seal(RING, "r-1", RECORD)
    assert check.verdict is SealVerdict.UNSIGNED


def test_a_seal_made_with_another_key_of_the_same_id_does_not_verify() -> None:
    forged = seal_record(OTHER, "r-1", RECORD)
    assert check_record_seal(RING, "r-1", forged).verdict is SealVerdict.BROKEN


@pytest.mark.parametrize(
    ("kid", "reason"), [("k9", "not held here"), ("k1", "retired key")], ids=["unknown", "retired"]
)
def test_a_seal_under_a_key_this_ring_cannot_use_is_unchecked(kid: str, reason: str) -> None:
    ring = KeyRing.from_secrets({kid: b"k" * 32}, signing_kid=kid)
    sealed = seal_record(ring, "r-1", RECORD)
    check = check_record_seal(RING, "r-1", sealed)
    assert check.verdict is SealVerdict.UNCHECKED and reason in check.reason


@pytest.mark.parametrize(
    "seal",
    [
        "k2:" + "0" * 64,
        {"kid": "k2"},
        {"kid": "k2", "mac": "zz" * 32},
        {"kid": "k2", "mac": "0" * 64, "more": 1},
        {"kid": 2, "mac": "0" * 64},
    ],
)
def test_a_malformed_seal_is_broken(seal: object) -> None:
    check = check_record_seal(RING, "r-1", {**RECORD, "seal": seal})
    assert check.verdict is SealVerdict.BROKEN


def test_floats_are_sealed_as_text_and_no_key_material_is_in_the_record() -> None:
    sealed = seal_record(RING, "r-1", {"kind": "x", "took_s": 1.5, "seal": "dropped"})
    assert sealed["took_s"] == "1.5"
    assert check_record_seal(RING, "r-1", stored(sealed)).verdict is SealVerdict.SEALED
    text = json.dumps(sealed)
    assert "6a6a6a" not in text and "jjjj" not in text


def test_values_the_strict_reader_would_refuse_are_sealed_as_text_that_reads_back() -> None:
    record = {"kind": "x", "path": "bad\udcff name", "seen": 2**70, "ok": True, "n": -3}
    sealed = seal_record(RING, "r-1", record)
    assert sealed["seen"] == str(2**70) and sealed["ok"] is True and sealed["n"] == -3
    back = strict_json_loads(json.dumps(sealed))
    assert isinstance(back, dict)
    assert check_record_seal(RING, "r-1", back).verdict is SealVerdict.SEALED
