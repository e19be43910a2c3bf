"""The reads of a walk over a sharded index, one pipeline each: a range of every shard,
merged in walk order, and a shard whose entries at the cursor's score changed since,
resumed after the cursor's member by name. The walk's pure half (its order, its cursors)
is :mod:`ratchet.leasing.walk`. Part of :class:`ratchet.leasing.listing.RunListings`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ratchet.errors import StoreProtocolError
from ratchet.leasing.sharded import ShardedIndexes
from ratchet.leasing.walk import (
    MAX_PAGE,
    Entry,
    Position,
    continued,
    merged,
    score_bound,
)

__all__ = ["WalkReads"]


class WalkReads(ShardedIndexes):
    """Entries of a sharded index in walk order (see the module docstring). Part of
    RedisStore."""

    def _ranges(
        self, reads: Sequence[tuple[str, str, str, int, int]], *, oldest_first: bool
    ) -> list[list[Entry]]:
        """For each ``(key, begin, end, offset, count)``: its entries from score ``begin``
        to score ``end`` in walk order (``ZRANGE ... BYSCORE [REV] LIMIT offset count``),
        tagged with the read's place in ``reads`` (its shard). One pipeline."""

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key, begin, end, offset, count in reads:
                pipe.zrange(
                    key,
                    begin,
                    end,
                    desc=not oldest_first,
                    byscore=True,
                    offset=offset,
                    num=count,
                    withscores=True,
                )
            return list(pipe.execute())

        replies = self._call("listing", None, read)
        if len(replies) != len(reads):
            raise StoreProtocolError("a listing reply is missing")
        parts: list[list[Entry]] = []
        for shard, ((key, *_), raw) in enumerate(zip(reads, replies, strict=True)):
            entries: list[Entry] = []
            for item in raw if isinstance(raw, list) else [None]:
                member, score = (
                    item if isinstance(item, list | tuple) and len(item) == 2 else (None, None)
                )
                if not isinstance(member, bytes) or not isinstance(score, float):
                    raise StoreProtocolError("an index entry is malformed", index=key)
                entries.append((member, score, shard))
            parts.append(entries)
        return parts

    def _entries(
        self,
        keys: Sequence[str],
        position: Position | None,
        count: int,
        oldest_first: bool,
    ) -> tuple[list[Entry], tuple[int, ...], float | None]:
        """Up to ``count`` entries after ``position`` in walk order, merged over the shards
        ``keys``, with how many entries at ``position``'s score the walk had passed in each
        shard before them."""
        near, far = ("-inf", "+inf") if oldest_first else ("+inf", "-inf")
        if position is None:
            parts = self._ranges(
                [(key, near, far, 0, count) for key in keys], oldest_first=oldest_first
            )
            return merged(parts, oldest_first)[:count], (0,) * len(keys), None
        here = score_bound(position.score)
        # One read per shard, all in one pipeline, in the usual case: from the last entry
        # the walk passed at that score (the cursor's own, in its shard), then what follows.
        parts = self._ranges(
            [
                (key, here, far, max(seen - 1, 0), count + (1 if seen else 0))
                for key, seen in zip(keys, position.seen, strict=True)
            ],
            oldest_first=oldest_first,
        )
        base = list(position.seen)
        for shard, key in enumerate(keys):
            rest = continued(parts[shard], position.seen[shard], position)
            if rest is None:
                rest, base[shard] = self._resume(key, shard, position, count)
            parts[shard] = rest
        return merged(parts, oldest_first)[:count], tuple(base), position.score

    def _resume(
        self, key: str, shard: int, position: Position, count: int
    ) -> tuple[list[Entry], int]:
        """Up to ``count`` entries after ``position`` in one shard whose entries at that
        score changed since: resumed after the member by name. Returns them and how many
        entries at that score the walk has passed there."""
        here = score_bound(position.score)
        far = "+inf" if position.oldest_first else "-inf"
        oldest_first = position.oldest_first
        [ties] = self._ranges([(key, here, here, 0, MAX_PAGE * 100)], oldest_first=oldest_first)
        later = [
            (m, s, shard)
            for m, s, _ in ties
            if (m > position.member if oldest_first else m < position.member)
        ]
        rest: list[Entry] = []
        if len(later) < count:
            [rest] = self._ranges(
                [(key, score_bound(position.score, exclusive=True), far, 0, count - len(later))],
                oldest_first=oldest_first,
            )
        return [*later, *((m, s, shard) for m, s, _ in rest)][:count], len(ties) - len(later)
