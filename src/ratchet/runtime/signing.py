"""Checkpoint envelopes: checksum plus HMAC-SHA256 under a key ring.

Wire format (bytes)::

    {"kid":"k2","len":4096,"mac":"<64 hex>","sum":"<64 hex>","v":1}\\n<payload bytes>

The header is canonical JSON on one line, parsed strictly (exact key set, no duplicates,
types checked); the payload follows byte for byte. ``sum`` is a plain SHA-256 of the
payload: it catches random corruption only, since anyone who can edit the payload can
recompute it. ``mac`` is HMAC-SHA256 over ``domain NUL kid NUL payload`` with the key named
by ``kid``; it proves the checkpoint came from a holder of the runtime key. Neither proves
freshness: that is the generation store's job.

Keys of at least 32 bytes are supplied from outside (environment or file). The newest key
signs; older keys only verify until retired. Key bytes live in :class:`SecretKey`, whose
``repr`` and ``str`` never show them.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson

from ratchet.errors import CheckpointError, ConfigurationError
from ratchet.runtime.canonical import (
    Domain,
    constant_time_equal,
    is_canonical,
)

__all__ = [
    "ENVELOPE_VERSION",
    "MIN_KEY_BYTES",
    "EnvelopeHeader",
    "KeyRing",
    "SecretKey",
    "open_envelope",
    "parse_envelope",
    "seal_envelope",
]

ENVELOPE_VERSION = 1
MIN_KEY_BYTES = 32
_HEADER_KEYS = frozenset({"kid", "len", "mac", "sum", "v"})
_MAX_HEADER = 512
_LOWER_HEX = re.compile(r"[0-9a-f]*")


class SecretKey:
    """Key bytes that never print. Compare and use only through :class:`KeyRing`."""

    __slots__ = ("__bytes",)

    def __init__(self, material: bytes) -> None:
        if not isinstance(material, bytes | bytearray):
            raise ConfigurationError("key material must be bytes")
        if len(material) < MIN_KEY_BYTES:
            raise ConfigurationError(
                f"checkpoint keys must be at least {MIN_KEY_BYTES} bytes", length=len(material)
            )
        self.__bytes = bytes(material)

    def mac(self, data: bytes) -> bytes:
        # hmac.digest: the one-shot form (OpenSSL's, no HMAC object); the same bytes.
        return hmac.digest(self.__bytes, data, "sha256")

    def __repr__(self) -> str:
        return "SecretKey(<redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("SecretKey cannot be pickled or copied out of process")


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Checkpoint HMAC keys by key id. ``signing_kid`` signs; every listed key verifies."""

    keys: Mapping[str, SecretKey]
    signing_kid: str
    retired: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.signing_kid not in self.keys:
            raise ConfigurationError("signing key id is not in the key ring", kid=self.signing_kid)
        if self.signing_kid in self.retired:
            raise ConfigurationError("the signing key is retired", kid=self.signing_kid)
        for kid in self.keys:
            if not kid or len(kid) > 64 or not kid.isascii() or not kid.isprintable():
                raise ConfigurationError("key ids must be 1..64 printable ASCII characters")

    @classmethod
    def from_secrets(
        cls, secrets: Mapping[str, bytes], *, signing_kid: str, retired: Iterable[str] = ()
    ) -> KeyRing:
        """Build a key ring from raw key bytes. Raises ConfigurationError."""
        return cls(
            {kid: SecretKey(m) for kid, m in secrets.items()}, signing_kid, frozenset(retired)
        )

    def __repr__(self) -> str:
        return f"KeyRing(kids={sorted(self.keys)!r}, signing_kid={self.signing_kid!r})"

    def mac(self, kid: str, payload: bytes, domain: bytes = Domain.CHECKPOINT) -> bytes:
        """HMAC-SHA256 of ``payload`` under key ``kid``, domain-separated: a checkpoint's
        MAC never verifies a run document's, or the other way round."""
        key = self.keys.get(kid)
        if key is None:
            raise CheckpointError(
                "checkpoint was signed with an unknown key id", reason="unknown_kid", kid=kid
            )
        if kid in self.retired:
            raise CheckpointError(
                "checkpoint was signed with a retired key", reason="retired_kid", kid=kid
            )
        return key.mac(_mac_input(kid, payload, domain))


def _mac_input(kid: str, payload: bytes, domain: bytes = Domain.CHECKPOINT) -> bytes:
    return domain + b"\x00" + kid.encode("ascii") + b"\x00" + payload


@dataclass(frozen=True, slots=True)
class EnvelopeHeader:
    kid: str
    length: int
    mac: str
    checksum: str


def seal_envelope(keyring: KeyRing, payload: bytes, *, domain: bytes = Domain.CHECKPOINT) -> bytes:
    """Sign ``payload`` with the ring's signing key and return the envelope bytes.
    ``domain`` separates what is signed (checkpoints, run documents)."""
    kid = keyring.signing_kid
    header = {
        "kid": kid,
        "len": len(payload),
        "mac": keyring.mac(kid, payload, domain).hex(),
        "sum": hashlib.sha256(payload).hexdigest(),
        "v": ENVELOPE_VERSION,
    }
    # Canonical bytes: sorted keys, compact; every value is a str or an int (no float walk).
    return orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n" + payload


def _bad(reason: str, message: str) -> CheckpointError:
    return CheckpointError(message, reason=reason)


def parse_envelope(blob: bytes) -> tuple[EnvelopeHeader, bytes]:
    """Strictly parse an envelope without verifying it.

    Raises:
        CheckpointError: reason ``malformed`` for anything but the exact format.
    """
    if not isinstance(blob, bytes | bytearray):
        raise _bad("malformed", "checkpoint must be bytes")
    cut = blob.find(b"\n", 0, _MAX_HEADER)
    if cut < 0:
        raise _bad("malformed", "checkpoint has no envelope header")
    raw_header, payload = bytes(blob[:cut]), bytes(blob[cut + 1 :])
    # Canonical bytes (no duplicate keys, sorted, compact) and then the exact key set.
    if not is_canonical(raw_header):
        raise _bad("malformed", "checkpoint envelope header is not canonical JSON")
    header = orjson.loads(raw_header)
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        raise _bad("malformed", "checkpoint envelope header has the wrong fields")
    kid, length, mac, checksum, version = (
        header["kid"],
        header["len"],
        header["mac"],
        header["sum"],
        header["v"],
    )
    if type(version) is not int or version != ENVELOPE_VERSION:
        raise _bad("envelope_version", "unsupported checkpoint envelope version")
    if type(length) is not int or length != len(payload):
        raise _bad("malformed", "checkpoint payload length does not match its header")
    for value in (kid, mac, checksum):
        if not isinstance(value, str):
            raise _bad("malformed", "checkpoint envelope header has the wrong types")
    if len(mac) != 64 or len(checksum) != 64 or not _is_hex(mac + checksum):
        raise _bad("malformed", "checkpoint digests are not 64 hex characters")
    return EnvelopeHeader(kid, length, mac, checksum), payload


def _is_hex(text: str) -> bool:
    """Only lowercase hex digits (one C-level regex match rather than a per-character loop)."""
    return _LOWER_HEX.fullmatch(text) is not None


def open_envelope(keyring: KeyRing, blob: bytes, *, domain: bytes = Domain.CHECKPOINT) -> bytes:
    """Verify an envelope signed under ``domain`` and return its payload bytes.

    Checks, in order: strict parse, checksum, HMAC (constant time). Raises
    CheckpointError with ``reason`` one of ``malformed``, ``envelope_version``,
    ``checksum``, ``unknown_kid``, ``retired_kid``, ``bad_mac``.
    """
    header, payload = parse_envelope(blob)
    if not constant_time_equal(hashlib.sha256(payload).hexdigest(), header.checksum):
        raise _bad("checksum", "checkpoint checksum does not match: corrupted")
    expected = keyring.mac(header.kid, payload, domain)
    if not hmac.compare_digest(expected.hex(), header.mac):
        raise _bad("bad_mac", "checkpoint HMAC does not verify: wrong key or tampered payload")
    return payload
