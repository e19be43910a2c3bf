"""A run's history as a window: the newest entries in memory, every older executed write
answered from a signed set of key digests (``docs/windowed-state.md``).

A run whose checkpoint names an archive keeps its trace events and executed writes in
the archive (one segment per commit, bound by a hash chain the checkpoint signs). The
state a worker holds carries only the newest of them: ``trace_base`` trace events and
``executed_base`` executed writes precede the window. What each step needs from older
history is one question, "was this idempotency key executed, and with which intent?",
and this module answers it without the old entries:

* :class:`KeySet` holds an 8-byte digest (:func:`key_digest`) of every executed write's
  key, in execution order, exactly as the store acknowledged them. The store keeps the
  same bytes beside the archive (appended by the commit script with each segment) and the
  checkpoint signs their SHA-256, so a restore reads one string, hashes it and compares:
  a store that hides, adds or reorders a digest is refused. A key whose digest is not in
  the set at an ordinal before the window was never executed by the run.
* A key whose digest is there is answered from the window when the entry is in it, and
  otherwise by a *recall* (:func:`ratchet.runtime.archive.recall_executed`): the
  archive before the window, checked against the chain value the checkpoint signs for the
  window's start, yields the entry at that ordinal, which must carry the key. Until
  recalled, :meth:`RunState.cached` raises :class:`NotInWindow`; the engine performs the
  recall (a store read) and asks again. Any mismatch fails closed.

Nothing here is trusted on its own: the digests are checked against signed values when
they are read (restore) and added only for writes the store acknowledged (the engine).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ratchet.runtime.state import ExecutedWrite

__all__ = [
    "DIGEST_BYTES",
    "WINDOW_SEGMENTS",
    "ArchiveWindow",
    "Cut",
    "KeySet",
    "NotInWindow",
    "choose_cut",
    "key_digest",
    "key_digests",
    "restore_tail",
]

DIGEST_BYTES = 8
# The window keeps at least this many of the newest archive segments and is cut back to
# about that once it holds twice as many: the in-memory history, a restore's reads and a
# step's appends cost O(this), not O(the run's length).
WINDOW_SEGMENTS = 16
_RECALLED_KEPT = 256
if array("Q").itemsize != DIGEST_BYTES:  # pragma: no cover - every platform CPython runs on
    raise ImportError("ratchet's key set needs 8-byte unsigned integers (array 'Q')")
_PERSON = b"ratchet/keys/v1"


def restore_tail() -> int:
    """How many of the archive's last segments a worker's restore reads: enough for any
    window (it spans at most about three times ``WINDOW_SEGMENTS``); a window that does
    not fit is read whole (``archive_short``)."""
    return 4 * WINDOW_SEGMENTS


def key_digest(key: str) -> bytes:
    """The 8-byte digest of idempotency key ``key`` kept in a run's key set."""
    return hashlib.blake2b(key.encode(), digest_size=DIGEST_BYTES, person=_PERSON).digest()


def key_digests(entries: Iterable[ExecutedWrite]) -> bytes:
    """The digests of ``entries``' keys, concatenated in order."""
    return b"".join(key_digest(e.idempotency_key) for e in entries)


class NotInWindow(Exception):  # noqa: N818 - a signal to the engine, not a failure
    """``key`` was executed before the window (at ``ordinal``) and its entry has not been
    recalled from the archive yet. Raised by :meth:`RunState.cached`; the engine recalls
    the entry and asks again. Never escapes the engine."""

    def __init__(self, key: str, ordinal: int) -> None:
        super().__init__(f"executed write {ordinal} is older than the window")
        self.key = key
        self.ordinal = ordinal


def _numbers(digests: bytes | bytearray) -> array[int]:
    """``digests`` as unsigned 64-bit integers (native order, as ``int.from_bytes`` with
    ``sys.byteorder`` reads one), converted in C."""
    numbers = array("Q")
    numbers.frombytes(digests)
    return numbers


class KeySet:
    """The key digests of a run's executed writes, in execution order (see the module
    docstring). Grows only; shared by the states of one engine, each of which asks only
    about ordinals before its own window (``older(key, base)``), so a state never sees a
    write it did not execute. Equality of run states is equality of their signed fields:
    a key set compares equal to any other, as a cache would.
    """

    __slots__ = ("_blob", "_hasher", "_index", "_recalled")

    def __init__(self, blob: bytes = b"") -> None:
        if len(blob) % DIGEST_BYTES:
            raise ValueError("a key set holds whole digests")
        self._blob = bytearray(blob)
        self._hasher = hashlib.sha256(blob)
        # digest (as an integer) -> its first ordinal; built on first use
        self._index: dict[int, int] | None = None
        self._recalled: OrderedDict[str, ExecutedWrite] = OrderedDict()

    def __repr__(self) -> str:
        return f"KeySet(count={self.count})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeySet)

    __hash__ = None  # type: ignore[assignment]

    @property
    def count(self) -> int:
        return len(self._blob) // DIGEST_BYTES

    @property
    def blob(self) -> bytes:
        return bytes(self._blob)

    def hexdigest(self) -> str:
        """SHA-256 of every digest held, the value a checkpoint signs."""
        return self._hasher.hexdigest()

    def hasher(self) -> Any:
        """A copy of the running SHA-256 over every digest held."""
        return self._hasher.copy()

    def digest_at(self, ordinal: int) -> bytes:
        start = ordinal * DIGEST_BYTES
        return bytes(self._blob[start : start + DIGEST_BYTES])

    def extend(self, digests: bytes) -> None:
        """Add the digests of writes the store acknowledged, in order."""
        if len(digests) % DIGEST_BYTES:
            raise ValueError("a key set holds whole digests")
        if not digests:
            return
        start = self.count
        self._blob += digests
        self._hasher.update(digests)
        index = self._index
        if index is not None:
            for ordinal, value in enumerate(_numbers(digests), start):
                index.setdefault(value, ordinal)

    def ordinal(self, key: str) -> int | None:
        """The first ordinal at which ``key``'s digest was executed, or None."""
        index = self._index
        if index is None:
            numbers = _numbers(self._blob)
            # Assigned newest first, so a digest seen twice keeps its first ordinal; zip,
            # reversed and dict() run in C (about 30 ns a digest).
            index = dict(zip(reversed(numbers), range(len(numbers) - 1, -1, -1), strict=True))
            self._index = index
        return index.get(int.from_bytes(key_digest(key), sys.byteorder))

    def older(self, key: str, base: int) -> int | None:
        """The ordinal of ``key`` when it was executed before ordinal ``base``, else None."""
        found = self.ordinal(key)
        return found if found is not None and found < base else None

    def recalled(self, key: str) -> ExecutedWrite | None:
        return self._recalled.get(key)

    def remember(self, entry: ExecutedWrite) -> None:
        """Keep an entry recalled (and verified) from the archive; bounded."""
        self._recalled[entry.idempotency_key] = entry
        while len(self._recalled) > _RECALLED_KEPT:
            self._recalled.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Cut:
    """A point where a window may start: after ``segments`` archive segments, which hold
    ``trace`` trace events and ``executed`` executed writes and end in ``chain``."""

    segments: int
    trace: int
    executed: int
    chain: str


@dataclass(frozen=True, slots=True)
class ArchiveWindow:
    """What the engine keeps beside a checkpoint's archive reference (memory only).

    ``cuts`` are the points the window may start at, oldest first; the first is where it
    starts now. ``hasher`` is the running SHA-256 over the key digests of every executed
    write the reference counts (copied, never shared, so each reference has its own).
    """

    keys: KeySet
    hasher: Any
    cuts: tuple[Cut, ...]


def choose_cut(
    window: ArchiveWindow,
    segments: int,
    trace_end: int,
    *,
    keep: int | None = None,
    keep_trace: int | None = None,
) -> Cut | None:
    """Where to move the window's start once it spans more than ``2 * keep`` of the
    ``segments`` archive segments: the newest cut that leaves at least ``keep`` segments
    and one trace event (``trace_end`` events in all) in the window, and whose executed
    writes the store has acknowledged (so the key set answers for every one of them).
    None: keep the window as it is. ``keep`` defaults to ``WINDOW_SEGMENTS``;
    ``keep_trace`` (an absolute trace index) is an event the window must keep."""
    if keep is None:
        keep = WINDOW_SEGMENTS
    if segments - window.cuts[0].segments <= 2 * keep:
        return None
    acknowledged = window.keys.count
    for cut in reversed(window.cuts[1:]):
        if (
            segments - cut.segments >= keep
            and cut.executed <= acknowledged
            and cut.trace < trace_end
            and (keep_trace is None or cut.trace <= keep_trace)
        ):
            return cut
    return None
