"""Every reply of the saver's scripts is decoded here into a typed result or a typed error.

Scripts reply ``{status, ...}``. Anything else (not a list, an unknown status, a wrong
length, a wrong type, text that is not UTF-8) raises
:class:`~ratchet.errors.StoreProtocolError`. Nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ratchet.errors import (
    ContractError,
    LeaseHeldElsewhereError,
    LeaseLostError,
)
from ratchet.leasing.replies import (
    check_arity,
    decode_acquire,
    decode_release_of,
    decode_renewal,
    int_field,
    lease_refused,
    protocol_error,
    split_reply,
    text_field,
)
from ratchet.leasing.results import LeaseHolder

__all__ = [
    "LEASE_KEY",
    "Entry",
    "GenerationMoved",
    "LeaseInfo",
    "ListReply",
    "ReadReply",
    "Rewritten",
    "Stored",
    "Takeover",
    "ThreadLease",
    "WritesStored",
    "decode_claim",
    "decode_lease_info",
    "decode_list",
    "decode_put",
    "decode_put_writes",
    "decode_read",
    "decode_release",
    "decode_renew",
    "decode_rewrite",
    "decode_takeover",
    "decode_takeover_log",
]


LEASE_KEY = "ratchet_lease"


@dataclass(frozen=True, slots=True)
class ThreadLease:
    """A lease on one thread: pass :meth:`as_config` in ``config["configurable"]``.

    ``expires_at_ms`` and ``now_ms`` are Redis server time when the lease was granted or
    last extended.
    """

    thread_id: str
    owner: str
    lease_version: int
    expires_at_ms: int
    now_ms: int

    def as_config(self) -> dict[str, Any]:
        """The nested object the saver reads from ``config["configurable"]["ratchet_lease"]``."""
        return {"owner": self.owner, "version": self.lease_version}

    def config(self, **configurable: Any) -> dict[str, Any]:
        """A LangGraph config for this thread carrying this lease (plus ``configurable``)."""
        return {
            "configurable": {
                "thread_id": self.thread_id,
                LEASE_KEY: self.as_config(),
                **configurable,
            }
        }


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """A thread's lease and generation as Redis reads them now."""

    thread_id: str
    owner: str | None
    lease_version: int
    expires_at_ms: int
    now_ms: int
    generation: int

    @property
    def live(self) -> bool:
        """True while an owner holds an unexpired lease (by Redis time)."""
        return self.owner is not None and self.now_ms < self.expires_at_ms


@dataclass(frozen=True, slots=True)
class Takeover:
    """One operator takeover of a thread's lease, as the store recorded it.

    ``at_ms`` is Redis server time; ``previous_owner`` is None when the lease was free and
    ``previous_live`` says whether its lease was still unexpired when it was taken.
    """

    thread_id: str
    at_ms: int
    owner: str
    lease_version: int
    previous_owner: str | None
    previous_lease_version: int
    previous_live: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Stored:
    generation: int
    lease_version: int
    expires_at_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class WritesStored:
    lease_version: int
    expires_at_ms: int
    now_ms: int
    written: int


@dataclass(frozen=True, slots=True)
class GenerationMoved:
    generation: int
    head: bytes


@dataclass(frozen=True, slots=True)
class Entry:
    digest: str
    record: bytes
    blobs: list[tuple[str, bytes]]
    writes: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True)
class ReadReply:
    generation: int
    head: bytes
    entries: list[Entry]


@dataclass(frozen=True, slots=True)
class ListReply:
    generation: int
    head: bytes
    before_generation: int
    members: list[tuple[str, int, str]]


@dataclass(frozen=True, slots=True)
class Rewritten:
    generation: int
    lease_version: int


# One set of reply primitives for every script ratchet ships.
_fail = protocol_error
_split = split_reply
_arity = check_arity
_int = int_field
_text = text_field


def _blob(value: object, script: str, name: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):  # fakeredis may hand back "" as str
        return value.encode("utf-8")
    _fail(f"field {name} is not bytes", script, field=name)


def _pairs(value: object, script: str, name: str) -> list[tuple[str, bytes]]:
    if not isinstance(value, list) or len(value) % 2:
        _fail(f"field {name} is not a list of pairs", script, field=name)
    return [
        (_text(value[i], script, name), _blob(value[i + 1], script, name))
        for i in range(0, len(value), 2)
    ]


def _unknown(status: str, script: str) -> NoReturn:
    _fail(f"unknown reply status '{status}'", script, status=status)


def _lease_refused(
    status: str, f: list[Any], script: str, thread_id: str, owner: str, lease_version: int
) -> NoReturn:
    _arity(f, 4, script, status)
    current_owner = _text(f[0], script, "owner")
    current_version = _int(f[1], script, "lease_version")
    expires = _int(f[2], script, "expires_at_ms")
    now = _int(f[3], script, "now_ms")
    if status == "held":
        raise LeaseHeldElsewhereError(
            "another live worker holds the thread's lease",
            thread_id=thread_id,
            owner=current_owner,
            lease_version=current_version,
            expires_at_ms=expires,
            now_ms=now,
        )
    lease_refused(
        status,
        f,
        script,
        owner=owner,
        lease_version=lease_version,
        subject={"thread_id": thread_id},
    )


def decode_put(
    reply: object, thread_id: str, owner: str, lease_version: int
) -> Stored | GenerationMoved:
    """Decode put. Raises LeaseHeldElsewhereError, LeaseLostError, ContractError (a blob the
    checkpoint reads was never stored), StoreProtocolError."""
    script = "put"
    status, f = _split(reply, script)
    if status == "stored":
        _arity(f, 4, script, status)
        return Stored(
            _int(f[0], script, "generation"),
            _int(f[1], script, "lease_version"),
            _int(f[2], script, "expires_at_ms"),
            _int(f[3], script, "now_ms"),
        )
    if status == "generation_moved":
        _arity(f, 2, script, status)
        return GenerationMoved(_int(f[0], script, "generation"), _blob(f[1], script, "head"))
    if status in ("held", "lease_lost", "lease_expired"):
        _lease_refused(status, f, script, thread_id, owner, lease_version)
    if status == "missing_blob":
        _arity(f, 1, script, status)
        raise ContractError(
            "the checkpoint holds a channel value that was never stored "
            "(its channel is missing from new_versions)",
            field="new_versions",
            thread_id=thread_id,
        )
    _unknown(status, script)


def decode_put_writes(
    reply: object, thread_id: str, owner: str, lease_version: int
) -> WritesStored:
    """Decode put_writes. Raises LeaseHeldElsewhereError, LeaseLostError, StoreProtocolError."""
    script = "put_writes"
    status, f = _split(reply, script)
    if status == "stored":
        _arity(f, 4, script, status)
        return WritesStored(
            _int(f[0], script, "lease_version"),
            _int(f[1], script, "expires_at_ms"),
            _int(f[2], script, "now_ms"),
            _int(f[3], script, "written"),
        )
    if status in ("held", "lease_lost", "lease_expired"):
        _lease_refused(status, f, script, thread_id, owner, lease_version)
    _unknown(status, script)


def decode_read(reply: object) -> ReadReply:
    """Decode read. Raises StoreProtocolError."""
    script = "read"
    status, f = _split(reply, script)
    if status != "read":
        _unknown(status, script)
    _arity(f, 3, script, status)
    raw = f[2]
    if not isinstance(raw, list):
        _fail("entries is not a list", script)
    entries: list[Entry] = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 4:
            _fail("an entry is not a 4-list", script)
        entries.append(
            Entry(
                _text(item[0], script, "digest"),
                _blob(item[1], script, "record"),
                _pairs(item[2], script, "blobs"),
                _pairs(item[3], script, "writes"),
            )
        )
    return ReadReply(_int(f[0], script, "generation"), _blob(f[1], script, "head"), entries)


def decode_list(reply: object) -> ListReply:
    """Decode list. Raises StoreProtocolError."""
    script = "list"
    status, f = _split(reply, script)
    if status != "ids":
        _unknown(status, script)
    _arity(f, 4, script, status)
    if not isinstance(f[3], list):
        _fail("members is not a list", script)
    members: list[tuple[str, int, str]] = []
    for raw in f[3]:
        parts = _text(raw, script, "member").split("|")
        if len(parts) != 3 or not parts[1].isdigit():
            _fail("an index member is malformed", script)
        members.append((parts[0], int(parts[1]), parts[2]))
    return ListReply(
        _int(f[0], script, "generation"),
        _blob(f[1], script, "head"),
        _int(f[2], script, "before_generation"),
        members,
    )


def decode_rewrite(
    reply: object, thread_id: str = "", lease: tuple[str, int] | None = None
) -> Rewritten | GenerationMoved | None:
    """Decode rewrite (None: the thread was never written); ``lease`` is the fenced
    caller's (owner, lease version), None for an unfenced rewrite. Raises LeaseLostError
    (fenced only), StoreProtocolError."""
    script = "rewrite"
    status, f = _split(reply, script)
    if lease is not None and status in ("lease_lost", "lease_expired"):
        _lease_refused(status, f, script, thread_id, lease[0], lease[1])
    if status == "rewritten":
        _arity(f, 2, script, status)
        return Rewritten(_int(f[0], script, "generation"), _int(f[1], script, "lease_version"))
    if status == "generation_moved":
        _arity(f, 2, script, status)
        return GenerationMoved(_int(f[0], script, "generation"), _blob(f[1], script, "head"))
    if status == "absent":
        _arity(f, 0, script, status)
        return None
    _unknown(status, script)


def decode_claim(reply: object, thread_id: str, owner: str) -> ThreadLease:
    """Decode acquire_lease on a thread (the runs' script and decoder). Raises
    LeaseHeldElsewhereError, StoreProtocolError."""
    got = decode_acquire(reply, thread_id, owner)
    if isinstance(got, LeaseHolder):
        raise LeaseHeldElsewhereError(
            "another live worker holds the thread's lease",
            thread_id=thread_id,
            owner=got.owner,
            lease_version=got.lease_version,
            expires_at_ms=got.expires_at_ms,
            now_ms=got.now_ms,
        )
    lease = got.lease
    return ThreadLease(thread_id, owner, lease.lease_version, lease.expires_at_ms, lease.now_ms)


def _flag(value: object, script: str, name: str) -> bool:
    number = _int(value, script, name)
    if number not in (0, 1):
        _fail(f"field {name} is not 0 or 1", script, field=name)
    return number == 1


def decode_takeover(
    reply: object, thread_id: str, owner: str, reason: str
) -> tuple[ThreadLease, Takeover]:
    """Decode takeover: the new lease and what it replaced. Raises StoreProtocolError."""
    script = "takeover"
    status, f = _split(reply, script)
    if status != "taken":
        _unknown(status, script)
    _arity(f, 6, script, status)
    version = _int(f[0], script, "lease_version")
    now = _int(f[2], script, "now_ms")
    lease = ThreadLease(thread_id, owner, version, _int(f[1], script, "expires_at_ms"), now)
    previous = _text(f[3], script, "previous_owner")
    return lease, Takeover(
        thread_id,
        now,
        owner,
        version,
        previous or None,
        _int(f[4], script, "previous_lease_version"),
        _flag(f[5], script, "previous_live"),
        reason,
    )


def decode_takeover_log(reply: object, thread_id: str) -> list[Takeover]:
    """Decode the entries of a thread's takeover log (LRANGE, newest first). Raises
    StoreProtocolError."""
    script = "takeovers"
    if not isinstance(reply, list):
        _fail("the takeover log is not a list", script)
    out: list[Takeover] = []
    for raw in reply:
        parts = _text(raw, script, "entry").split("|", 6)
        if len(parts) != 7 or not all(p.isdigit() for p in (parts[0], parts[2], parts[4])):
            _fail("a takeover log entry is malformed", script)
        if parts[5] not in ("0", "1"):
            _fail("a takeover log entry is malformed", script)
        out.append(
            Takeover(
                thread_id,
                int(parts[0]),
                parts[1],
                int(parts[2]),
                parts[3] or None,
                int(parts[4]),
                parts[5] == "1",
                parts[6],
            )
        )
    return out


def _no_thread(lease: ThreadLease) -> Callable[[], NoReturn]:
    def missing() -> NoReturn:
        raise LeaseLostError(
            "the thread's lease is no longer held (the thread has no lease record)",
            thread_id=lease.thread_id,
            owner=lease.owner,
            lease_version=lease.lease_version,
            reason="lease_lost",
        )

    return missing


def decode_renew(reply: object, lease: ThreadLease) -> ThreadLease:
    """Decode renew_lease on a thread (the runs' script and decoder). Raises
    LeaseLostError, StoreProtocolError."""
    expires, now = decode_renewal(
        reply,
        owner=lease.owner,
        lease_version=lease.lease_version,
        subject={"thread_id": lease.thread_id},
        missing=_no_thread(lease),
    )
    return ThreadLease(lease.thread_id, lease.owner, lease.lease_version, expires, now)


def decode_release(reply: object, lease: ThreadLease) -> None:
    """Decode release_lease on a thread (the runs' script and decoder). Raises
    LeaseLostError, StoreProtocolError."""
    decode_release_of(
        reply,
        owner=lease.owner,
        lease_version=lease.lease_version,
        subject={"thread_id": lease.thread_id},
        missing=_no_thread(lease),
    )


def decode_lease_info(reply: object, thread_id: str) -> LeaseInfo:
    """Decode lease_info. Raises StoreProtocolError."""
    script = "lease_info"
    status, f = _split(reply, script)
    if status != "lease":
        _unknown(status, script)
    _arity(f, 5, script, status)
    owner = _text(f[0], script, "owner")
    return LeaseInfo(
        thread_id,
        owner or None,
        _int(f[1], script, "lease_version"),
        _int(f[2], script, "expires_at_ms"),
        _int(f[3], script, "now_ms"),
        _int(f[4], script, "generation"),
    )
