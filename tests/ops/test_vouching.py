"""Judging an export's records one by one, on whatever a store writer could have left:
nothing malformed raises anything but the typed refusal of a broken seal, nothing without
a seal or signature that verifies reads as vouched for, and what is shown is printable."""

from __future__ import annotations

import base64
import json

import pytest

from ratchet.errors import IntegrityError
from ratchet.fleet.control import new_cancel_request, seal_cancel
from ratchet.ops.vouching import judge_history, judge_inbox, judge_incidents
from ratchet.runtime import KeyRing
from ratchet.runtime.seals import seal_record

RING = KeyRing.from_secrets({"k1": b"k" * 32}, signing_kid="k1")
ELSEWHERE = KeyRing.from_secrets({"k7": b"z" * 32}, signing_kid="k7")


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    "entry",
    [
        "1|1|0||c-1|" + "0" * 64 + "|1700000000000",
        "9" * 5000 + "|1|0|w|c-1|d|1",  # no huge integers are parsed
        "²|1|0|w|c-1|d|1",  # a digit Python's int() would refuse
        '{"kind":"operator_retry","operator":"alice"}',
        "\x1b[2J|||||||",
        "",
    ],
)
def test_every_history_entry_is_unsigned_whatever_it_holds(entry: str) -> None:
    part = judge_history([entry])
    (record,) = part.records
    assert (part.vouched, record.status, record.vouched) == (False, "unsigned", False)
    assert all(c.isprintable() for c in record.ident + record.by)


@pytest.mark.parametrize(
    "stored",
    [
        '1700000000000|{"kind":"operator_retry","operator":"alice"}',
        "1700000000000|not json",
        '1700000000000|["a","list"]',
        '1700000000000|{"kind":"x","kind":"y"}',  # duplicate keys
        "no time at all",
        "9" * 5000 + '|{"kind":"x"}',
        '1|{"kind":"operator_retry","operator":"alice\\u001b[31m"}',
        {"kind": "from a format 1 file", "at_ms": 5},
        42,
    ],
)
def test_an_incident_without_a_seal_is_unsigned_whatever_it_holds(stored: object) -> None:
    part = judge_incidents(RING, "r-1", [stored])
    (record,) = part.records
    assert (part.vouched, record.status) == (False, "unsigned")
    assert all(c.isprintable() for c in record.kind + record.ident + record.by + record.note)


def test_a_sealed_incident_is_vouched_for_and_one_sealed_elsewhere_is_unchecked() -> None:
    ours = seal_record(RING, "r-1", {"id": "inc-1", "kind": "operator_retry", "operator": "bob"})
    theirs = seal_record(ELSEWHERE, "r-1", {"id": "inc-2", "kind": "note"})
    part = judge_incidents(RING, "r-1", [f"5|{json.dumps(ours)}", f"6|{json.dumps(theirs)}"])
    assert [(r.status, r.by, r.at_ms) for r in part.records] == [
        ("sealed", "bob", 5),
        ("unchecked", "", 6),
    ]
    assert part.vouched is False and "not held here" in part.records[1].note


def test_a_sealed_incident_with_a_field_changed_is_refused_with_a_typed_error() -> None:
    sealed = seal_record(RING, "r-1", {"id": "inc-1", "kind": "operator_retry", "operator": "bob"})
    changed = {**sealed, "operator": "alice"}
    with pytest.raises(IntegrityError, match="incident #0") as caught:
        judge_incidents(RING, "r-1", [f"5|{json.dumps(changed)}"])
    assert caught.value.context["check"] == "incident_seal"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"kind":"approval","approver_id":"alice"}',
        b'{"looks like":"an envelope"}\nbut is not',
        b"\x00\xff binary",
        b"",
    ],
)
def test_an_inbox_entry_that_is_neither_sealed_nor_signed_is_unsigned(raw: bytes) -> None:
    part = judge_inbox(RING, "r-1", [b64(raw)])
    (record,) = part.records
    assert (part.vouched, record.status) == (False, "unsigned")
    assert all(c.isprintable() for c in record.ident)


def test_a_cancel_request_is_sealed_only_for_its_own_run_and_its_own_keys() -> None:
    request = new_cancel_request("r-1", by="carol", reason="stop", now_ms=7)
    part = judge_inbox(RING, "r-1", [b64(seal_cancel(RING, request))])
    assert [(r.status, r.kind, r.by, r.at_ms) for r in part.records] == [
        ("sealed", "cancel", "carol", 7)
    ]
    elsewhere = judge_inbox(RING, "r-1", [b64(seal_cancel(ELSEWHERE, request))])
    assert elsewhere.records[0].status == "unchecked" and not elsewhere.vouched
    with pytest.raises(IntegrityError, match="another run"):
        judge_inbox(RING, "r-2", [b64(seal_cancel(RING, request))])
    changed = seal_cancel(RING, request).replace(b'"by":"carol"', b'"by":"alice"')
    with pytest.raises(IntegrityError, match="does not verify"):
        judge_inbox(RING, "r-1", [b64(changed)])
