"""Signed records: how the saver turns checkpoints, channel values, pending writes and head
records into bytes, and back, refusing anything it did not sign for exactly that place.

Every record is a :func:`ratchet.runtime.signing.seal_envelope` envelope (HMAC-SHA256 under
the checkpoint key ring, ``kid`` in the header) around this payload::

    b"ratchet/langgraph/v1\\x00" + canonical JSON of the binding + b"\\n"
        + serde type tag + b"\\n" + serde bytes

The binding names where the record belongs, so a validly signed record moved to another
thread, namespace, checkpoint, channel, version or write slot is refused:

=============  ==========================================================================
kind           binding fields
=============  ==========================================================================
``head``       thread_id, generation
``checkpoint`` thread_id, ns, checkpoint_id, parent_id, generation
``blob``       thread_id, ns, channel, version
``write``      thread_id, ns, checkpoint_id, task_id, task_path, idx, channel
=============  ==========================================================================

The domain prefix keeps these payloads apart from ratchet's own run checkpoints, which are
canonical JSON objects and never start with it.

Values are encoded by LangGraph's serializer (``serde.dumps_typed``). The bytes are only
deserialized after the HMAC and the binding verified. Only the type tags ``msgpack``,
``null``, ``bytes``, ``bytearray`` and ``json`` are accepted in either direction: a
serializer that falls back to ``pickle`` is refused when writing, and a ``pickle`` record
is refused when reading, whatever the serializer would allow.
"""

from __future__ import annotations

from typing import Any

import orjson
from langgraph.checkpoint.serde.base import SerializerProtocol

from ratchet.errors import CheckpointError, ContractError
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.signing import KeyRing, open_envelope, seal_envelope

__all__ = ["ALLOWED_TYPES", "RecordCodec", "version_key"]

_MAGIC = b"ratchet/langgraph/v1\x00"
ALLOWED_TYPES = frozenset({"msgpack", "null", "bytes", "bytearray", "json"})
_FIELDS: dict[str, frozenset[str]] = {
    "head": frozenset({"kind", "thread_id", "generation"}),
    "checkpoint": frozenset(
        {"kind", "thread_id", "ns", "checkpoint_id", "parent_id", "generation"}
    ),
    "blob": frozenset({"kind", "thread_id", "ns", "channel", "version"}),
    "write": frozenset(
        {"kind", "thread_id", "ns", "checkpoint_id", "task_id", "task_path", "idx", "channel"}
    ),
}


def version_key(version: object) -> str:
    """The text that stands for a channel version in bindings and field names.

    Versions are ints, floats or strings in LangGraph; the type is kept so ``1`` and
    ``"1"`` never meet. Raises ContractError for anything else.
    """
    if isinstance(version, bool):
        raise ContractError("a channel version cannot be a bool", field="channel_versions")
    if isinstance(version, int):
        return f"i:{version}"
    if isinstance(version, float):
        return f"f:{version!r}"
    if isinstance(version, str):
        return f"s:{version}"
    raise ContractError("a channel version must be an int, float or str", field="channel_versions")


def _bad(reason: str, message: str, **context: Any) -> CheckpointError:
    return CheckpointError(message, reason=reason, **context)


class RecordCodec:
    """Seals and opens the saver's records with one key ring and one serializer."""

    def __init__(self, keyring: KeyRing, serde: SerializerProtocol) -> None:
        self.keyring = keyring
        self.serde = serde

    def __repr__(self) -> str:
        return f"RecordCodec(keyring={self.keyring!r})"

    def seal(self, binding: dict[str, Any], value: Any) -> bytes:
        """Sign ``value`` for the place ``binding`` names.

        Raises ContractError when the serializer picks a type outside :data:`ALLOWED_TYPES`
        (pickle) or the binding holds a float.
        """
        type_tag, data = self.serde.dumps_typed(value)
        if type_tag not in ALLOWED_TYPES:
            raise ContractError(
                f"the serializer produced type {type_tag!r}; only "
                f"{sorted(ALLOWED_TYPES)} are stored (never pickle)",
                field="serde",
            )
        payload = (
            _MAGIC
            + canonical_json(binding)
            + b"\n"
            + type_tag.encode("ascii")
            + b"\n"
            + bytes(data)
        )
        return seal_envelope(self.keyring, payload)

    def open(self, blob: bytes, expect: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Verify ``blob`` and return its binding and value.

        ``expect`` must hold ``kind`` and may hold any other binding field; each must match
        exactly. Raises CheckpointError with ``reason`` one of the envelope's reasons
        (``malformed``, ``checksum``, ``unknown_kid``, ``retired_kid``, ``bad_mac``, ...),
        ``binding`` (signed for another place) or ``serde_type`` (a type tag outside
        :data:`ALLOWED_TYPES`).
        """
        kind = expect["kind"]
        if not isinstance(blob, bytes | bytearray) or not blob:
            raise _bad("missing", f"the {kind} record is missing", kind=kind)
        payload = open_envelope(self.keyring, bytes(blob))
        if not payload.startswith(_MAGIC):
            raise _bad("malformed", f"the {kind} record is not a LangGraph record", kind=kind)
        cut = payload.find(b"\n", len(_MAGIC))
        cut2 = payload.find(b"\n", cut + 1) if cut >= 0 else -1
        if cut < 0 or cut2 < 0:
            raise _bad("malformed", f"the {kind} record has no binding", kind=kind)
        try:
            binding = orjson.loads(payload[len(_MAGIC) : cut])
        except orjson.JSONDecodeError:
            raise _bad("malformed", f"the {kind} record's binding is not JSON", kind=kind) from None
        if not isinstance(binding, dict) or set(binding) != _FIELDS.get(kind, frozenset()):
            raise _bad("binding", f"the {kind} record has another shape", kind=kind)
        for name, value in expect.items():
            got = binding[name]
            if got != value or type(got) is not type(value):
                raise _bad(
                    "binding",
                    f"the {kind} record was signed for another {name}",
                    kind=kind,
                    field=name,
                )
        type_tag = payload[cut + 1 : cut2].decode("ascii", errors="replace")
        if type_tag not in ALLOWED_TYPES:
            raise _bad("serde_type", f"the {kind} record holds type {type_tag!r}", kind=kind)
        return binding, self.serde.loads_typed((type_tag, payload[cut2 + 1 :]))
