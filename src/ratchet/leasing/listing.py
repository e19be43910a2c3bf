"""Listings that stay true at any size: runs a page at a time from the runs index or one
phase's index, newest (or oldest) first, with exact counts.

A page costs one ``ZRANGE`` of the index (``BYSCORE ... LIMIT``, so its cost does not
grow with the index) and one pipeline that reads the listed runs' state and lease hashes
and their newest incident. No checkpoint is read and nothing is verified: a row shows
what the index and the state hash say (the phase is the unsigned metadata commits carry,
see ``lua/commit.lua``); a run's own view (``ratchet show``, the console's run page)
verifies its checkpoint. A row that cannot be read says why in ``problem`` and never
takes the page down.

On Redis Cluster each index is split into shards (:class:`~ratchet.leasing.keyspace.IndexLayout`):
a page reads the same range of every shard in one pipeline and merges them in walk order
(score, then member, as Redis orders one key), so a page costs one round trip and at most
``limit + 1`` entries per shard. A single Redis is the one-shard case of the same walk.

Cursors are opaque text naming the last entry a page showed: its score, its member and,
per shard, how many entries with that score the walk had passed, so runs with equal
scores (created in the same millisecond) are each listed exactly once. If the entries with
that score changed in between in a shard (a run left the index), the next page re-reads
that score there and resumes after the member by its name (:mod:`ratchet.leasing.walk`).
A cursor is refused by a store with another number of shards. An entry that moves within
the index while it is walked (a run that entered a phase again) shows at its new place,
which an ongoing walk may already have passed.

Counts are ``ZCARD`` of each index (summed over its shards): exact, at any size. Runs
created before phase indexes existed have no phase in their state hash and are in no phase index:
:meth:`RunListings.runs_missing_phase` finds them and :meth:`RunListings.record_phase`
indexes one (``ratchet store init`` does both, reading each phase from the run's verified
checkpoint).

This module holds the pages, the searches and the counts. The rows are read by
:mod:`ratchet.leasing.listedruns`, the walk's reads are :mod:`ratchet.leasing.walkreads`'
(its order and cursors, pure, :mod:`ratchet.leasing.walk`'s), and the runs a phase index
lacks are found and listed again by :mod:`ratchet.leasing.phasebackfill`; RedisStore takes
them all through :class:`RunListings`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ratchet.errors import ContractError, StoreProtocolError
from ratchet.leasing.keyspace import PHASES, IndexLayout
from ratchet.leasing.listedruns import ListedRows, ListedRun
from ratchet.leasing.phasebackfill import PhaseBackfill
from ratchet.leasing.walk import (
    MAX_PAGE,
    Position,
    decode_cursor,
    merged,
    position_after,
)

__all__ = ["MAX_PAGE", "ListedRun", "RunListings", "RunPage"]

_SEARCH_CHUNK = 200


@dataclass(frozen=True, slots=True)
class RunPage:
    """A page of a listing. ``next_cursor`` is None on the last page; ``scanned`` is how
    many index entries were examined (a search examines more than it returns)."""

    rows: tuple[ListedRun, ...]
    next_cursor: str | None
    phase: str | None  # the index listed (None: every run, by creation time)
    oldest_first: bool
    scanned: int
    now_ms: int


def _check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ContractError(f"limit must be an integer from 1 to {MAX_PAGE}", field="limit")
    return limit


class RunListings(PhaseBackfill, ListedRows):
    """Paged, counted listings of runs (see the module docstring). Part of RedisStore."""

    _inline_indexes: bool  # set by RedisStore: a single Redis (not a Cluster)
    _indexes: IndexLayout  # set by RedisStore

    def index_keys(self, run_id: str | None = None) -> tuple[str, ...]:
        """Every cross-run index key a run may be in (runs, expiry, each phase: removing
        a run must remove it from each), or with no run every index key. On a Cluster each
        index is sharded: the run's own shard of each, or every shard."""
        return self._indexes.keys_of(run_id)

    # -- counts -------------------------------------------------------------------------

    def phase_counts(self) -> dict[str, int]:
        """How many runs each phase index holds (``ZCARD`` of each shard, one pipeline):
        exact.

        Raises StoreUnavailableError, StoreProtocolError.
        """
        per_phase = [self._indexes.phase(phase) for phase in PHASES]
        counts = iter(self._zcards([key for keys in per_phase for key in keys]))
        return {
            phase: sum(next(counts) for _ in keys)
            for phase, keys in zip(PHASES, per_phase, strict=True)
        }

    def run_count(self) -> int:
        """How many runs the runs index holds. Raises StoreUnavailableError."""
        return sum(self._zcards(self._indexes.runs()))

    def _zcards(self, keys: Sequence[str]) -> list[int]:
        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.zcard(key)
            return list(pipe.execute())

        counts = self._call("index counts", None, read)
        if len(counts) != len(keys) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in counts
        ):
            raise StoreProtocolError("an index count is not an integer")
        return [int(n) for n in counts]

    # -- pages --------------------------------------------------------------------------

    def list_runs(
        self,
        phase: str | None = None,
        *,
        limit: int = 50,
        after: str | None = None,
        oldest_first: bool = False,
    ) -> RunPage:
        """A page of runs: those in ``phase`` (by the time they entered it) or every run
        (by creation time), newest first unless ``oldest_first``, continuing after the
        cursor ``after`` (a page's ``next_cursor``).

        Raises ContractError (unknown phase, a limit outside 1..1000, a cursor this
        listing did not give out or one of the other order), StoreUnavailableError.
        """
        keys, start = self._start(phase, limit, after, oldest_first)
        chunk, base, base_score = self._entries(keys, start, limit + 1, oldest_first)
        more = len(chunk) > limit
        chunk = chunk[:limit]
        rows, now_ms = self._rows(chunk)
        cursor = (
            position_after(chunk, len(chunk) - 1, base, base_score, oldest_first).encode()
            if more and chunk
            else None
        )
        return RunPage(tuple(rows), cursor, phase, oldest_first, len(chunk), now_ms)

    def search_runs(
        self,
        prefix: str,
        phase: str | None = None,
        *,
        limit: int = 50,
        after: str | None = None,
        oldest_first: bool = False,
        budget: int = 5000,
    ) -> RunPage:
        """Like :meth:`list_runs`, keeping only the runs whose id, task id or live lease
        owner starts with ``prefix`` (exact, case-sensitive). At most ``budget`` index
        entries are examined per call; ``next_cursor`` then continues the search where it
        stopped, so a search never claims more than it looked at (``scanned``).

        Raises what :meth:`list_runs` raises, and ContractError for an empty prefix.
        """
        if not isinstance(prefix, str) or not prefix or len(prefix) > 200:
            raise ContractError("the search text must be 1 to 200 characters", field="search")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ContractError("budget must be a positive integer", field="budget")
        keys, start = self._start(phase, limit, after, oldest_first)
        found: list[ListedRun] = []
        scanned, now_ms = 0, 0
        position = start
        while scanned < budget:
            want = min(_SEARCH_CHUNK, budget - scanned)
            chunk, base, base_score = self._entries(keys, position, want, oldest_first)
            if not chunk:
                return RunPage(tuple(found), None, phase, oldest_first, scanned, now_ms)
            rows, now_ms = self._rows(chunk)
            for i, row in enumerate(rows):
                scanned += 1
                if any(
                    isinstance(v, str) and v.startswith(prefix)
                    for v in (row.run_id, row.task_id, row.owner)
                ):
                    found.append(row)
                    if len(found) == limit:
                        end = position_after(chunk, i, base, base_score, oldest_first)
                        return RunPage(
                            tuple(found), end.encode(), phase, oldest_first, scanned, now_ms
                        )
            position = position_after(chunk, len(chunk) - 1, base, base_score, oldest_first)
            if len(chunk) < want:
                return RunPage(tuple(found), None, phase, oldest_first, scanned, now_ms)
        return RunPage(
            tuple(found),
            position.encode() if position else None,
            phase,
            oldest_first,
            scanned,
            now_ms or self.server_time_ms(),
        )

    def run_ids(self, *, limit: int = 1000) -> list[str]:
        """Run ids created through this store, oldest first (up to ``limit``), read a
        thousand at a time. Raises ContractError (a limit below 1), StoreUnavailableError."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ContractError("limit must be a positive integer", field="limit")
        keys = self._indexes.runs()
        found: list[str] = []
        position: Position | None = None
        while len(found) < limit:
            want = min(MAX_PAGE, limit - len(found))
            chunk, base, base_score = self._entries(keys, position, want, True)
            found += [self._member(member) for member, _, _ in chunk]
            if len(chunk) < want:
                break
            position = position_after(chunk, len(chunk) - 1, base, base_score, True)
        return found

    def entered_before(self, phase: str, before_ms: int, *, limit: int) -> list[str]:
        """Up to ``limit`` runs that entered ``phase`` at or before ``before_ms`` (Redis
        ms), earliest first. Raises ContractError (unknown phase), StoreUnavailableError."""
        keys = self._indexes.phase(phase)
        parts = self._ranges(
            [(key, "-inf", str(before_ms), 0, limit) for key in keys], oldest_first=True
        )
        return [self._member(member) for member, _, _ in merged(parts, True)[:limit]]

    def _start(
        self, phase: str | None, limit: int, after: str | None, oldest_first: bool
    ) -> tuple[tuple[str, ...], Position | None]:
        _check_limit(limit)
        keys = self._indexes.runs() if phase is None else self._indexes.phase(phase)
        if after is None or after == "":
            return keys, None
        position = decode_cursor(after)
        if position.oldest_first != bool(oldest_first):
            raise ContractError("the cursor was given out for the other order", field="after")
        if len(position.seen) != len(keys):
            raise ContractError(
                "the cursor was given out by a store with another number of index shards",
                field="after",
            )
        return keys, position
