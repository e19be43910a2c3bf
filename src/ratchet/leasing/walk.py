"""The walk of a listing over an index split into shards, and its cursors: pure
functions, no Redis (the reads are :mod:`ratchet.leasing.walkreads`').

An index is one sorted set per shard (one shard on a single Redis). A walk visits the
entries of every shard in one order, by score then member as Redis orders one key
(``REV``: both descending), and a page stops after some entry. Its cursor names that entry
(score and member) and, per shard, how many entries with that score the walk had passed
there: the next page reads each shard from that offset, and :func:`continued` checks the
offset still holds (the entries at that score may have changed); when it does not, the
caller resumes that shard by name. A count is only a fast path: a wrong one costs a read,
never a wrong row.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ratchet.errors import ContractError

__all__ = [
    "MAX_PAGE",
    "Entry",
    "Position",
    "continued",
    "decode_cursor",
    "merged",
    "position_after",
    "score_bound",
]

#: The most entries a page of a listing shows (and a read of a walk takes at a time).
MAX_PAGE = 1000
_MAX_CURSOR = 1024
_MAX_SHARDS = 64
#: An index entry as a walk holds it: member, score, and the shard it was read from.
Entry = tuple[bytes, float, int]


@dataclass(frozen=True, slots=True)
class Position:
    """Where a walk stands: after ``member`` at ``score``; ``seen[n]`` is how many entries
    with that score the walk had passed in shard ``n``."""

    oldest_first: bool
    score: float
    seen: tuple[int, ...]
    member: bytes

    def encode(self) -> str:
        seen = ",".join(str(n) for n in self.seen)
        head = f"{'o' if self.oldest_first else 'n'}:{self.score!r}:{seen}:".encode()
        return base64.urlsafe_b64encode(head + self.member).rstrip(b"=").decode("ascii")


def _bad_cursor() -> ContractError:
    return ContractError("the cursor is not one this listing gave out", field="after")


def decode_cursor(text: str) -> Position:
    """The position a cursor names. Raises ContractError (``field="after"``)."""
    if not isinstance(text, str) or not 0 < len(text) <= _MAX_CURSOR:
        raise _bad_cursor()
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        order, score_text, seen_text, member = raw.split(b":", 3)
        score = float(score_text.decode("ascii"))
        seen = tuple(int(n.decode("ascii")) for n in seen_text.split(b","))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise _bad_cursor() from None
    if (
        order not in (b"n", b"o")
        or math.isnan(score)
        or not 1 <= len(seen) <= _MAX_SHARDS
        or not all(0 <= n <= 10**9 for n in seen)
        or sum(seen) < 1
        or not member
    ):
        raise _bad_cursor()
    return Position(order == b"o", score, seen, member)


def score_bound(score: float, *, exclusive: bool = False) -> str:
    """``score`` as a ``ZRANGE ... BYSCORE`` bound (``exclusive``: with ``(``)."""
    text = "+inf" if score == math.inf else "-inf" if score == -math.inf else repr(score)
    return f"({text}" if exclusive else text


def position_after(
    chunk: Sequence[Entry],
    i: int,
    base: Sequence[int],
    base_score: float | None,
    oldest_first: bool,
) -> Position:
    """The position after entry ``i`` of ``chunk``, whose walk had passed ``base[n]``
    entries with score ``base_score`` in shard ``n`` before the chunk began."""
    member, score, _ = chunk[i]
    seen = list(base) if score == base_score else [0] * len(base)
    for _, s, shard in chunk[: i + 1]:
        if s == score:
            seen[shard] += 1
    return Position(oldest_first, score, tuple(seen), member)


def merged(parts: Sequence[Sequence[Entry]], oldest_first: bool) -> list[Entry]:
    """The shards' entries in walk order: by score then member, as Redis orders one key
    (``REV``: both descending)."""
    entries = [entry for part in parts for entry in part]
    entries.sort(key=lambda e: (e[1], e[0]), reverse=not oldest_first)
    return entries


def continued(got: list[Entry], seen: int, position: Position) -> list[Entry] | None:
    """What follows ``position`` in one shard, from a read that began ``seen - 1``
    entries into its score (at the score when nothing was passed there), or None when the
    entries at that score changed since the cursor was given out."""

    def passed(member: bytes) -> bool:
        if position.oldest_first:
            return member <= position.member
        return member >= position.member

    if seen:
        head = got[0] if got else None
        if head is None or head[1] != position.score or not passed(head[0]):
            return None
        got = got[1:]
    if got and got[0][1] == position.score and passed(got[0][0]):
        return None
    return got
