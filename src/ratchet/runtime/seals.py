"""Seals on the records workers and operators leave beside a run (its incidents).

An incident is a JSON object the store keeps as it is, beside the run's checkpoint
(``ratchet:{<run>}:incidents``). Whoever writes one holds the fleet's checkpoint key ring
(a worker, its reaper, an operator's ``ratchet retry``) and seals it as it is written
(:func:`seal_record`): the record gets a ``seal`` field ``{"kid": <key id>, "mac": <64
hex>}``, an HMAC-SHA256 under the ring's signing key, in the records' own domain
(``ratchet/incident/v1``), over the canonical JSON of ``{"record": <the record without its
seal>, "run_id": <the run>}``. A sealed record therefore can be neither changed nor moved
to another run without the key, and a record pushed into Redis by hand carries no seal
that verifies.

What a seal does not vouch for: that the list is complete (anyone who can write the store
can delete, reorder or repeat sealed records), and the time the store stamps beside each
record (outside the seal: the record is sealed before the store's clock is read).

:func:`check_record_seal` judges one record, without raising: ``sealed`` (the seal
verifies), ``unsigned`` (no seal: written before records were sealed, by a process without
the key ring, or by hand), ``unchecked`` (a key id this ring does not hold, or holds
retired: it cannot be checked here) or ``broken`` (a seal that does not verify: the record
was changed after it was sealed, or was sealed for another run). Key bytes never appear in
a record, a reason or a ``repr``.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ratchet.errors import ContractError
from ratchet.runtime.canonical import Domain, canonical_json
from ratchet.runtime.signing import KeyRing

__all__ = ["SEAL_FIELD", "SealCheck", "SealVerdict", "check_record_seal", "seal_record"]

SEAL_FIELD = "seal"
_MAC_HEX = re.compile(r"[0-9a-f]{64}")


class SealVerdict(StrEnum):
    """What a record's seal says about it (see the module docstring)."""

    SEALED = "sealed"
    UNSIGNED = "unsigned"
    UNCHECKED = "unchecked"
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class SealCheck:
    """A verdict and, for every verdict but ``sealed``, why (one line, no key material)."""

    verdict: SealVerdict
    reason: str = ""
    kid: str | None = None


_INT64 = 1 << 63


def _text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (an undecodable file name, say)
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _plain(value: Any) -> Any:
    """The record as canonical JSON (and the strict reader) holds it: floats and integers
    past 64 bits become their text, text is valid UTF-8, tuples become lists, keys become
    text. So a record JSON could hold before it was sealed can still be sealed."""
    if isinstance(value, Mapping):
        return {_text(str(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, float) or (
        isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64
    ):
        return repr(value)
    return value


def _signed_bytes(run_id: str, body: Mapping[str, Any]) -> bytes:
    return canonical_json({"record": body, "run_id": run_id})


def seal_record(
    keyring: KeyRing, run_id: str, record: Mapping[str, Any], *, domain: bytes = Domain.INCIDENT
) -> dict[str, Any]:
    """``record`` (made plain: floats as text and so on; any ``seal`` it had dropped) with
    its seal for ``run_id`` under the ring's signing key.

    Raises ContractError: the record holds a value JSON cannot (bytes, an object).
    """
    body = _plain({k: v for k, v in record.items() if k != SEAL_FIELD})
    kid = keyring.signing_kid
    mac = keyring.mac(kid, _signed_bytes(run_id, body), domain)
    return {**body, SEAL_FIELD: {"kid": kid, "mac": mac.hex()}}


def check_record_seal(
    keyring: KeyRing, run_id: str, record: Mapping[str, Any], *, domain: bytes = Domain.INCIDENT
) -> SealCheck:
    """Judge ``record``'s seal for ``run_id`` (see the module docstring). Never raises."""
    if SEAL_FIELD not in record:
        return SealCheck(SealVerdict.UNSIGNED, "it carries no seal")
    seal = record[SEAL_FIELD]
    if (
        not isinstance(seal, Mapping)
        or set(seal) != {"kid", "mac"}
        or not isinstance(seal["kid"], str)
        or not isinstance(seal["mac"], str)
        or _MAC_HEX.fullmatch(seal["mac"]) is None
    ):
        return SealCheck(SealVerdict.BROKEN, "its seal is malformed")
    kid: str = seal["kid"]
    shown = kid[:64] if kid.isascii() and kid.isprintable() else "?"
    if kid not in keyring.keys:
        return SealCheck(SealVerdict.UNCHECKED, f"sealed with key {shown!r}, not held here", shown)
    if kid in keyring.retired:
        return SealCheck(SealVerdict.UNCHECKED, f"sealed with retired key {shown!r}", shown)
    try:
        signed = _signed_bytes(run_id, {k: v for k, v in record.items() if k != SEAL_FIELD})
    except ContractError:
        return SealCheck(SealVerdict.BROKEN, "its body is not canonical JSON", shown)
    expected = keyring.mac(kid, signed, domain).hex()
    if not hmac.compare_digest(expected, seal["mac"]):
        return SealCheck(
            SealVerdict.BROKEN,
            "its seal does not verify: changed after it was sealed, or sealed for another run",
            shown,
        )
    return SealCheck(SealVerdict.SEALED, kid=shown)
